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


def test_room_grows_to_held_results_plus_a_call_once_then_is_reused(pool):
    big = {"x": 3 * MIN_CHUNK}
    p, new, _ = pool.allocate(big)
    assert [c.size for c in new] == [6 * MIN_CHUNK]  # the call, plus one call of room
    held = [_views(pool, p, big)]
    p, new, _ = pool.allocate(big)  # the first result still held (being saved): fits in the room
    assert new == []
    held.append(_views(pool, p, big))
    p, new, _ = pool.allocate(big)  # two held: grows once, to the demand (9) plus a call (3)
    assert [c.size for c in new] == [6 * MIN_CHUNK]
    held.append(_views(pool, p, big))
    for _ in range(6):  # a steady pipeline of two results in flight: no new memory
        held.pop(0)
        gc.collect()
        p, new, dropped = pool.allocate(big)
        assert new == [] and dropped == []
        held.append(_views(pool, p, big))
    assert pool.stats["chunks_created"] == 2 and pool.capacity == 12 * MIN_CHUNK
    del held, p
    gc.collect()


def test_where_the_memory_cannot_hold_the_room_a_call_gets_what_it_needs(pool, monkeypatch):
    real = exchange.os.posix_fallocate
    limit = 3 * MIN_CHUNK  # e.g. a small /dev/shm: the call fits, the call plus a call of room does not

    def small_shm(fd, offset, length):
        if length > limit:
            raise OSError(28, "No space left on device")
        return real(fd, offset, length)

    monkeypatch.setattr(exchange.os, "posix_fallocate", small_shm)
    big = {"x": 3 * MIN_CHUNK}
    p, new, _ = pool.allocate(big)
    assert [c.size for c in new] == [3 * MIN_CHUNK]
    pool.release(p)
    p, new, _ = pool.allocate(big)  # and the next call reuses it
    assert new == []
    pool.release(p)
    with pytest.raises(ExchangeError, match="cannot reserve"):  # more than the memory holds: one clear error
        pool.allocate({"y": 4 * MIN_CHUNK})


def test_idle_capacity_beyond_the_recent_demand_is_trimmed(pool):
    big = {"x": 3 * MIN_CHUNK}
    held = []
    for _ in range(3):  # e.g. a caller that collects every result, then saves them
        p, _, _ = pool.allocate(big)
        held.append(_views(pool, p, big))
    del held, p
    gc.collect()
    capacity = pool.capacity
    small = {"s": ALIGN}
    for _ in range(exchange.WINDOW - 3):  # the large demand is among the last WINDOW calls: kept
        ps, news, dropped = pool.allocate(small)
        assert news == [] and dropped == [] and pool.capacity == capacity
        pool.release(ps)
    dropped_all = []
    for _ in range(3):  # it leaves the window: the idle chunks go; the one in use stays
        ps, news, dropped = pool.allocate(small)
        assert news == []
        dropped_all += dropped
        pool.release(ps)
    assert len(dropped_all) == 1 and pool.capacity == capacity - 6 * MIN_CHUNK == 6 * MIN_CHUNK
    assert pool.peak_demand == ALIGN and pool.peak_call_bytes == ALIGN


def test_a_caller_that_saves_every_n_calls_keeps_its_room(pool, monkeypatch):
    """A caller that holds its results for 40 calls, then saves and drops them all (N < WINDOW):
    the room made in the first round serves every later round; nothing is made again."""
    monkeypatch.setattr(exchange, "MIN_CHUNK", 4 * ALIGN)  # small chunks: the rounds span many
    call = {"x": 4 * ALIGN}
    held: list = []
    created = []
    for k in range(400):
        p, _, _ = pool.allocate(call)
        held.append(_views(pool, p, call))
        if k % 40 == 39:  # the save: every held result dropped
            held.clear()
            gc.collect()
            created.append(pool.stats["chunks_created"])
    assert pool.stats["chunks_dropped"] == 0 and len(set(created)) == 1, created
    del held, p
    gc.collect()


def test_a_run_without_contiguous_room_is_placed_key_by_key_in_the_holes(pool):
    quarter = {k: MIN_CHUNK // 4 for k in "abcdefgh"}
    p, new, _ = pool.allocate(quarter)
    assert len(new) == 1 and new[0].size == 4 * MIN_CHUNK  # the call and a call of room
    views = _views(pool, p, quarter)
    p_fill, new_fill, _ = pool.allocate(quarter)  # fills the room: the chunk is full
    assert new_fill == []
    filled = _views(pool, p_fill, quarter)
    for k in "aceg":  # free every other quarter: four holes of MIN/4, none larger
        del views[k]
    gc.collect()
    p2, new2, _ = pool.allocate_runs([[("x", MIN_CHUNK // 4), ("y", MIN_CHUNK // 4)]])  # a run of MIN/2
    assert new2 == []  # its two keys went into two holes
    assert p2["x"][0] == p2["y"][0] == new[0].id and p2["x"][1] != p2["y"][1]
    taken = {(p[k][1]) for k in "bdfh"}
    assert not taken & {p2["x"][1], p2["y"][1]}
    del views, filled
    pool.release(p2)


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


def test_a_reserve_made_before_the_calls_holds_calls_and_saves_without_growth(pool):
    """``reserve`` grows once, rounded to MIN_CHUNK; calls and results held within it make no
    memory and do not drop it; a reserve the pool already holds makes nothing."""
    call = {f"r{i}": MIN_CHUNK // 4 for i in range(2)}  # half a chunk per call
    new = pool.reserve(2 * MIN_CHUNK + 1)
    assert [c.size for c in new] == [3 * MIN_CHUNK] and pool.capacity == 3 * MIN_CHUNK
    assert pool.stats["chunks_reserved"] == 1 and pool.stats["bytes_reserved"] == 3 * MIN_CHUNK
    assert pool.reserve(3 * MIN_CHUNK) == [] and pool.reserve(MIN_CHUNK) == []
    held = []
    for n in range(300):  # more than WINDOW calls; the caller keeps two calls' results alive
        placements, made, dropped = pool.allocate(call)
        assert made == [] and dropped == [], n
        held.append(_views(pool, placements, call))
        if len(held) > 2:
            held.pop(0)
    assert pool.stats["chunks_created"] == 1 and pool.capacity == 3 * MIN_CHUNK
    # beyond the reserve, the pool grows as before
    placements, made, _ = pool.allocate({"big": 2 * MIN_CHUNK})
    assert len(made) == 1 and pool.stats["chunks_reserved"] == 1


def test_a_reserve_adds_only_what_the_pool_lacks_and_never_half_the_free_space(pool, monkeypatch):
    pool.allocate({"a": MIN_CHUNK // 2})  # the first call made one chunk
    assert pool.capacity == MIN_CHUNK
    assert [c.size for c in pool.reserve(3 * MIN_CHUNK)] == [2 * MIN_CHUNK]
    assert pool.capacity == 3 * MIN_CHUNK

    class Full:  # the folder has 5 chunks' worth free: a reserve takes at most 2 of them
        f_bavail, f_frsize = 5 * MIN_CHUNK // 4096, 4096

    monkeypatch.setattr(exchange.os, "statvfs", lambda _d: Full)
    assert [c.size for c in pool.reserve(10 * MIN_CHUNK)] == [2 * MIN_CHUNK]
    Full.f_bavail = MIN_CHUNK // 4096
    assert pool.reserve(20 * MIN_CHUNK) == []  # less than a chunk may be taken: nothing
