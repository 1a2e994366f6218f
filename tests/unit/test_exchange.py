"""The exchange pool's mechanics (real shared-memory files, no vLLM): leases, recycling when
the caller drops results, growth only while results are held, trimming, failure paths."""

from __future__ import annotations

import gc
import os

import pytest

from speculators_compat import exchange
from speculators_compat.exchange import ALIGN, MIN_CHUNK, ExchangeError, ExchangePool


@pytest.fixture
def pool(tmp_path):
    return ExchangePool(str(tmp_path))


def _views(pool, placements, sizes):
    return {k: pool.lease_view(placements[k], sizes[k]) for k in sizes}


def test_one_chunk_serves_a_call_and_is_reused_after_results_are_dropped(pool, tmp_path):
    sizes = {f"r{i}": 1000 * (i + 1) for i in range(8)}
    placements, new, dropped = pool.allocate(sizes)
    assert len(new) == 1 and dropped == []
    assert new[0].size == MIN_CHUNK
    # segments are page-aligned, disjoint, and large enough
    spans = sorted((off, off + n) for _, off, n in placements.values())
    assert all(off % ALIGN == 0 for off, _ in spans)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert all(placements[k][2] >= sizes[k] for k in sizes)
    assert os.listdir(tmp_path) == []  # both sides hold mappings; nothing left on disk
    views = _views(pool, placements, sizes)
    views["r3"][:4] = b"abcd"
    assert pool.chunks[new[0].id].map[placements["r3"][1] : placements["r3"][1] + 4] == b"abcd"
    assert pool.leased == sum(p[2] for p in placements.values())
    del views
    gc.collect()
    assert pool.leased == 0
    for _ in range(5):  # same shape again: no new memory
        placements2, new2, dropped2 = pool.allocate(sizes)
        assert new2 == [] and dropped2 == []
        views = _views(pool, placements2, sizes)
        del views
    assert pool.stats["chunks_created"] == 1
    assert pool.capacity == MIN_CHUNK


def test_results_held_by_the_caller_are_never_reused(pool):
    sizes = {"a": MIN_CHUNK // 2, "b": MIN_CHUNK // 2}
    p1, new1, _ = pool.allocate(sizes)
    held = _views(pool, p1, sizes)
    p2, new2, _ = pool.allocate(sizes)
    assert len(new2) == 1  # the first chunk is fully leased
    first = {(c, o) for c, o, _ in p1.values()}
    assert not first & {(c, o) for c, o, _ in p2.values()}
    del held


def test_freed_segments_coalesce(pool):
    sizes = {k: ALIGN for k in "abcd"}
    p, new, _ = pool.allocate(sizes)
    views = _views(pool, p, sizes)
    for k in ("b", "a", "d", "c"):
        del views[k]
        gc.collect()
    pool.leased  # noqa: B018 - drains the released queue
    assert pool.chunks[new[0].id].free == [(0, MIN_CHUNK)]


def test_idle_capacity_is_trimmed_to_twice_the_largest_call(pool):
    big = {"x": 3 * MIN_CHUNK}
    p, new, _ = pool.allocate(big)
    held = _views(pool, p, big)
    p2, new2, _ = pool.allocate(big)  # a second chunk while the first is held
    del held
    views2 = _views(pool, p2, big)
    del views2
    gc.collect()
    assert pool.capacity == 6 * MIN_CHUNK  # 2x the peak: kept
    small = {"s": ALIGN}
    for _ in range(3):
        ps, news, dropped = pool.allocate(small)
        assert news == [] and dropped == []
        pool.release(ps)
    pool.peak_call_bytes = ALIGN  # as if only small calls had been seen
    ps, news, dropped = pool.allocate(small)
    assert len(dropped) == 1 and pool.capacity == 3 * MIN_CHUNK
    pool.release(ps)


def test_failed_call_gives_its_leases_back(pool):
    p, new, _ = pool.allocate({"a": 5000, "b": 7000})
    pool.release(p)
    assert pool.leased == 0
    assert pool.chunks[new[0].id].free == [(0, MIN_CHUNK)]


def test_no_space_is_a_clear_error_and_keeps_the_pool_consistent(pool, monkeypatch):
    p, new, _ = pool.allocate({"a": 5000})
    held = pool.lease_view(p["a"], 5000)

    def no_space(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(exchange.os, "posix_fallocate", no_space)
    with pytest.raises(ExchangeError, match=r"cannot reserve \d+ bytes .*No space left.*SPECULATORS_COMPAT_SHM_DIR"):
        pool.allocate({"b": MIN_CHUNK, "c": 100})
    assert os.listdir(pool.directory) == []
    assert pool.leased == p["a"][2]  # only the held result; the failed call's leases went back
    del held


def test_shm_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECULATORS_COMPAT_SHM_DIR", str(tmp_path))
    assert exchange.shm_dir() == str(tmp_path)
    assert ExchangePool().directory == str(tmp_path)


def test_chunks_of_a_failed_begin_are_forgotten(pool):
    p, new, _ = pool.allocate({"a": 5000})
    pool.release(p)
    pool.forget(new)
    assert pool.chunks == {}
    p2, new2, _ = pool.allocate({"a": 5000})
    assert len(new2) == 1 and new2[0].id != new[0].id  # ids are never reused


def test_allocate_runs_lays_a_run_back_to_back_and_gives_it_all_back(tmp_path):
    from speculators_compat.exchange import ALIGN, GRAIN

    pool = ExchangePool(str(tmp_path))
    runs = [[(("a", k), 640), (("b", k), 384), (("c", k), 100)] for k in range(2)]
    placements, new, _ = pool.allocate_runs(runs)
    assert len(new) == 1
    for k in range(2):
        (ca, oa, ra), (cb, ob, rb), (cc, oc, rc) = (placements[(x, k)] for x in "abc")
        assert ca == cb == cc and ob == oa + 640 and oc == ob + 384  # back to back, in order
        assert oa % ALIGN == 0 and (ra, rb) == (640, 384)
        assert rc % GRAIN == 0 and (ra + rb + rc) % ALIGN == 0  # the last key holds the run's padding
    assert pool.leased == 2 * ALIGN
    pool.release(placements)
    assert pool.leased == 0
    chunk = pool.chunks[new[0].id]
    assert chunk.free == [(0, chunk.size)]  # the pieces coalesced back into one free range
