"""The worker's copies with real torch: the driver lays a layer's blocks back to back
(``ExchangePool.allocate_runs``), the worker merges a step's spans whose source rows and
destination memory are contiguous into one copy (``CaptureState.merge_copies``), and every row
still lands in its own sequence's block, chunked prefill included; where the blocks cannot be
back to back (a row size that is not a multiple of the grain) each span is its own copy."""

from __future__ import annotations

import gc
import os
from types import SimpleNamespace

import pytest

from speculators_compat.exchange import ExchangePool
from speculators_compat.extraction.capture import CaptureState
from speculators_compat.extraction.protocol import Begin

pytestmark = pytest.mark.contract

torch = pytest.importorskip("torch")

LENGTHS = {"r0": 5, "r1": 3, "r2": 4}
LAYERS = (1, 3)
# (step, batch order): r1 is chunked over both steps
STEPS = [({"r0": (5, 0), "r1": (2, 0)}, ["r0", "r1"]), ({"r1": (1, 2), "r2": (4, 0)}, ["r1", "r2"])]


def run_call(tmp_path, hidden: int, steps=STEPS):
    pool = ExchangePool(str(tmp_path))
    row_bytes = hidden * 2
    placements, new, _ = pool.allocate_runs(
        [[((rid, k), n * row_bytes) for rid, n in LENGTHS.items()] for k in range(len(LAYERS))]
    )
    worker = SimpleNamespace(_captured_states=None, model_runner=SimpleNamespace(input_batch=SimpleNamespace(req_ids=[])))
    state = CaptureState(worker, LAYERS)
    state.capture, state.runner_kind = True, "v1"
    state.begin(Begin(call=0, caller_pid=os.getpid(), new_chunks={c.id: c.ref() for c in new},
                      live_chunks=tuple(sorted(pool.chunks)), layers=len(LAYERS), hidden=hidden, pin=False,
                      placements={rid: ([placements[(rid, k)][:2] for k in range(len(LAYERS))], n)
                                  for rid, n in LENGTHS.items()}))
    expected = {rid: [torch.zeros(n, hidden, dtype=torch.bfloat16) for _ in LAYERS] for rid, n in LENGTHS.items()}
    copies_per_step = []
    for step, order in steps:
        worker.model_runner.input_batch.req_ids = order
        state.set_step(step)
        state.spans = state.compute_spans()
        state.copies = state.merge_copies(state.spans)
        copies_per_step.append([len(c) for c in state.copies])
        rows = sum(n for n, _ in step.values())
        for slot in range(len(LAYERS)):
            stream = torch.randn(rows, hidden).to(torch.bfloat16)
            src = 0
            for rid in order:
                n, done = step[rid]
                expected[rid][slot][done:done + n] = stream[src:src + n]
                src += n
            state._copy_rows(slot, stream)
    counts = state.finish()["written"]
    got = {rid: [torch.frombuffer(pool.lease_view(placements[(rid, k)], n * row_bytes), dtype=torch.bfloat16).view(n, hidden)
                 for k in range(len(LAYERS))] for rid, n in LENGTHS.items()}
    return expected, got, counts, copies_per_step, placements


def test_contiguous_spans_are_one_copy_per_layer_and_step(tmp_path):
    expected, got, counts, copies, placements = run_call(tmp_path, hidden=64)  # 128-byte rows
    assert copies == [[1, 1], [1, 1]], copies  # three spans per layer would be three copies
    for rid, n in LENGTHS.items():
        assert counts[rid] == [n, n]
        for slot in range(len(LAYERS)):
            assert torch.equal(got[rid][slot], expected[rid][slot]), (rid, slot)
    # a layer's blocks lie back to back, in input order
    for k in range(len(LAYERS)):
        offs = [placements[(rid, k)][1] for rid in LENGTHS]
        assert [b - a for a, b in zip(offs, offs[1:])] == [LENGTHS["r0"] * 128, LENGTHS["r1"] * 128]
    del got
    gc.collect()


def test_blocks_that_cannot_touch_are_copied_span_by_span(tmp_path):
    expected, got, counts, copies, _ = run_call(tmp_path, hidden=36)  # 72-byte rows: padded to 64-byte grains
    assert copies == [[2, 2], [2, 2]], copies
    for rid, n in LENGTHS.items():
        assert counts[rid] == [n, n]
        for slot in range(len(LAYERS)):
            assert torch.equal(got[rid][slot], expected[rid][slot]), (rid, slot)
    del got
    gc.collect()


def test_a_shifted_span_is_not_merged_into_its_neighbour(tmp_path, monkeypatch):
    """A source row out of line breaks the run: the merge never hides a misplaced span."""
    original = CaptureState.compute_spans

    def shifted(self):
        spans = original(self)
        src, rid, d, n = spans[-1]
        spans[-1] = (src - 1, rid, d, n)
        return spans

    monkeypatch.setattr(CaptureState, "compute_spans", shifted)
    expected, got, counts, copies, _ = run_call(tmp_path, hidden=64)
    assert copies == [[2, 2], [2, 2]], copies
    assert not torch.equal(got["r1"][0], expected["r1"][0])  # r1's first rows came one row early
    del got
    gc.collect()


def test_a_step_past_a_sequences_rows_is_refused_before_any_copy(tmp_path):
    """The copies write raw ranges of the exchange memory: a step placing rows beyond a
    sequence's block (a miscount) must fail there, never spill into the next block."""
    with pytest.raises(RuntimeError, match="places rows 0..4 of 'r1', which has 3 rows"):
        run_call(tmp_path, hidden=64, steps=[({"r0": (5, 0), "r1": (4, 0)}, ["r0", "r1"])])  # r1 has 3 rows
