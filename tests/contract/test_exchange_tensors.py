"""The exchange pool with real torch tensors, as the generator hands them out: a result's
segment stays leased while any tensor, view or slice of it lives, and comes back after."""

from __future__ import annotations

import gc

import pytest

from speculators_compat.exchange import ExchangePool

pytestmark = pytest.mark.contract

torch = pytest.importorskip("torch")


def test_tensor_views_keep_their_segment_until_the_last_one_dies(tmp_path):
    pool = ExchangePool(str(tmp_path))
    layers, n, hidden = 3, 17, 64
    nbytes = layers * n * hidden * 2
    placements, new, _ = pool.allocate({"a": nbytes, "b": nbytes})
    pool.unlink(new)
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
