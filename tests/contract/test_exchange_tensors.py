"""The exchange pool with real torch tensors, as the generator hands them out: a result's
segment stays leased while any tensor, view or slice of it lives, and comes back after."""

from __future__ import annotations

import gc

import pytest

import os

from speculators_compat.exchange import ExchangePool

pytestmark = pytest.mark.contract

torch = pytest.importorskip("torch")


def test_tensor_views_keep_their_segment_until_the_last_one_dies(tmp_path):
    pool = ExchangePool(str(tmp_path))
    layers, n, hidden = 3, 17, 64
    nbytes = layers * n * hidden * 2
    placements, new, _ = pool.allocate({"a": nbytes, "b": nbytes})
    bufs = {
        k: torch.frombuffer(pool.lease_view(placements[k], nbytes), dtype=torch.bfloat16).view(layers, n, hidden)
        for k in placements
    }
    bufs["a"].fill_(1.5)
    per_layer = [bufs["a"][k] for k in range(layers)]  # what generate() returns
    row = per_layer[2][5:9]
    del bufs, per_layer
    gc.collect()
    leased_b = placements["b"][2]
    assert pool.leased == placements["a"][2]  # "a" held through `row`; "b" came back
    assert torch.all(row == 1.5)
    p2, new2, _ = pool.allocate({"c": nbytes})
    assert new2 == [] and (p2["c"][0], p2["c"][1]) == (placements["b"][0], placements["b"][1])
    assert leased_b == p2["c"][2]
    pool.release(p2)
    del row
    gc.collect()
    assert pool.leased == 0


def test_the_worker_side_opens_the_callers_chunk_and_refuses_another(tmp_path):
    from speculators_compat.extraction.capture import ChunkMismatch, map_chunk
    from speculators_compat.extraction.protocol import ChunkRef

    pool = ExchangePool(str(tmp_path))
    _, new, _ = pool.allocate({"a": 4096})
    chunk = new[0]
    chunk.view[:4] = b"abcd"
    tensor, _mm = map_chunk(os.getpid(), chunk.ref())
    assert bytes(tensor[:4].tolist()) == b"abcd"
    wrong = ChunkRef(fd=chunk.fd, dev=chunk.dev, ino=chunk.ino + 1, size=chunk.size)
    with pytest.raises(ChunkMismatch, match="is not the file the caller created"):
        map_chunk(os.getpid(), wrong)


def test_each_layer_tensor_owns_its_storage(tmp_path):
    """generate leases one block per (sequence, layer): saving one layer writes one layer."""
    import io

    pool = ExchangePool(str(tmp_path))
    n, hidden = 33, 64
    placements, _, _ = pool.allocate({("r", k): n * hidden * 2 for k in range(3)})
    layers = [torch.frombuffer(pool.lease_view(placements[("r", k)], n * hidden * 2), dtype=torch.bfloat16).view(n, hidden) for k in range(3)]
    for t in layers:
        assert t.untyped_storage().nbytes() == n * hidden * 2
    buf = io.BytesIO()
    torch.save(layers[1], buf)
    assert len(buf.getvalue()) < n * hidden * 2 + 2048  # one layer, not three
