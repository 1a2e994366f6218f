"""The worker side of the self-check with real torch (``CaptureState`` hooks + ``RowCheck.report``,
judged by ``selfcheck.judge``): one call over two steps (a chunked sequence) through the exchange.
Correct rows pass with every kind seen — in bf16, and in fp16 where a layer keeps its residual in
fp32 (vLLM's GemmaRMSNorm does) — a corrupted exchange row, a misplaced span and a stream that
is not the residual stream fail; tensors in another layout are not covered, never an error."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from speculators_compat.exchange import ExchangePool
from speculators_compat.extraction.capture import CaptureState
from speculators_compat.extraction.protocol import Begin
from speculators_compat.extraction.selfcheck import SelfCheckFailed, judge
from speculators_compat.layers import FUSED_RESIDUAL, LayerAdapter

pytestmark = pytest.mark.contract

torch = pytest.importorskip("torch")

HIDDEN = 64
SEQS = {"r0": [5, 9, 13, 17, 21], "r1": [6, 10, 14], "r2": [7, 11, 15, 19]}
LAYERS = (1, 3)  # 3 is the last of 4: the final norm is checked
# (step, batch order): r1 is chunked over both steps
STEPS = [({"r0": (5, 0), "r1": (2, 0)}, ["r0", "r1"]), ({"r1": (1, 2), "r2": (4, 0)}, ["r1", "r2"])]


class Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, HIDDEN))

    def forward(self, x, residual=None):
        if residual is not None:
            x = x + residual
        xf = x.float()
        out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight).to(x.dtype)
        return out if residual is None else (out, x)


def run_call(tmp_path, dtype=torch.bfloat16, fp32_residual=False, adapter=FUSED_RESIDUAL, positions_layout=None,
             corrupt=None, misplace=False, rows=16, nan_at=None):
    pool = ExchangePool(str(tmp_path))
    itemsize = torch.empty((), dtype=dtype).element_size()
    row_bytes = HIDDEN * itemsize
    lengths = {rid: len(ids) for rid, ids in SEQS.items()}
    placements, new, _ = pool.allocate_runs(
        [[((rid, k), n * row_bytes) for rid, n in lengths.items()] for k in range(len(LAYERS))])
    worker = SimpleNamespace(_captured_states=None, model_runner=SimpleNamespace(input_batch=SimpleNamespace(req_ids=[])))
    state = CaptureState(worker, LAYERS)
    state.capture, state.runner_kind = True, "v1"
    norm = Norm().to(dtype)
    state.final_norm, state.final_slot = norm, state.slot[3]
    state.begin(Begin(call=0, caller_pid=os.getpid(), new_chunks={c.id: c.ref() for c in new},
                      live_chunks=tuple(sorted(pool.chunks)), layers=len(LAYERS), hidden=HIDDEN, pin=False,
                      dtype=str(dtype).replace("torch.", ""), check_rows=rows,
                      placements={rid: ([placements[(rid, k)][:2] for k in range(len(LAYERS))], n)
                                  for rid, n in lengths.items()}))
    torch.manual_seed(0)
    for step, order in STEPS:
        worker.model_runner.input_batch.req_ids = order
        state.set_step(step)
        ids = torch.tensor([t for rid in order for t in SEQS[rid][step[rid][1]:step[rid][1] + step[rid][0]]])
        pos = torch.tensor([p for rid in order for p in range(step[rid][1], step[rid][1] + step[rid][0])])
        if misplace:  # the runner's batch in another order than the capture reads it
            worker.model_runner.input_batch.req_ids = list(reversed(order))
        state.on_input_ids(ids)
        state.on_positions(pos if positions_layout is None else positions_layout(pos))
        n = len(ids)
        for lid in LAYERS:
            hidden = torch.randn(n, HIDDEN).to(dtype) * 3
            if nan_at is not None and lid == 3 and step is STEPS[0][0]:
                hidden[nan_at] = float("nan")  # the model itself computes a NaN row: its final norm output too
            residual = torch.randn(n, HIDDEN).to(torch.float32 if fp32_residual else dtype)
            state.on_layer_output(lid, adapter, None, (hidden, residual))
            if lid == 3:
                state.on_final_norm(norm(hidden.to(residual.dtype), residual)[0].to(dtype))
    if corrupt is not None:
        rid, slot, row = corrupt
        state.block(rid, slot)[row] += 1
    reply = state.finish()
    return reply, judge([reply["check"]], SEQS, LAYERS)


@pytest.mark.parametrize("dtype, fp32_residual", [(torch.bfloat16, False), (torch.float32, False),
                                                  (torch.float16, True)])
def test_correct_rows_pass_with_every_kind_seen(tmp_path, dtype, fp32_residual):
    reply, summary = run_call(tmp_path, dtype, fp32_residual)
    assert reply["written"] == {rid: [len(ids)] * 2 for rid, ids in SEQS.items()}
    # every sequence's first and last row of each step: r0 2, r1 2 + 1, r2 2
    assert summary["rows"] == 7 and summary["tokens_checked"] == 7 and summary["positions_checked"] == 7
    assert summary["copies_checked"] == 14 and summary["final_rows"] == 7 and summary["not_covered"] == []
    assert summary["final_max_rel_error"] < 0.02, summary


def test_a_corrupted_exchange_row_fails(tmp_path):
    with pytest.raises(SelfCheckFailed, match="row 4 of r0, layer 3"):
        run_call(tmp_path, corrupt=("r0", 1, 4))


def test_rows_read_in_another_batch_order_fail(tmp_path):
    with pytest.raises(SelfCheckFailed, match="another sequence's token"):
        run_call(tmp_path, misplace=True)


def test_a_nan_the_engine_computed_fails_naming_the_engine(tmp_path):
    with pytest.raises(SelfCheckFailed, match=r"1 row\(s\) where the model's own final-norm output is non-finite "
                                              r"\(NaN/inf computed by the engine.*row 0 of r0"):
        run_call(tmp_path, nan_at=0)


def test_a_stream_that_is_not_the_residual_stream_fails_at_the_final_norm(tmp_path):
    hidden_only = LayerAdapter("hidden-only", lambda out: out[0], FUSED_RESIDUAL.required)
    with pytest.raises(SelfCheckFailed, match="final-norm output"):
        run_call(tmp_path, adapter=hidden_only)


def test_another_layout_is_not_covered_never_an_error(tmp_path):
    _, summary = run_call(tmp_path, positions_layout=lambda p: p.view(-1, 1).expand(-1, 2).contiguous())
    assert summary["positions_checked"] == 0
    assert summary["not_covered"] == ["positions (no sampled row reached it)"], summary
    (tmp_path / "short").mkdir()
    _, summary = run_call(tmp_path / "short", positions_layout=lambda p: p[:2])  # fewer rows than the step
    assert summary["positions_checked"] == 0 and summary["tokens_checked"] == 7


def test_off_checks_nothing_and_says_so(tmp_path):
    _, summary = run_call(tmp_path, rows=0)
    assert summary["rows"] == 0 and summary["not_covered"] == ["off (SPECULATORS_COMPAT_SELF_CHECK_ROWS=0)"]


def test_the_gather_reads_each_row_where_it_lies_in_every_chunk():
    """``gather_rows`` (one index per chunk over its row-long windows) against one slice per row:
    rows in two chunks, at aligned and odd offsets, the last row of a chunk, in mixed order."""
    from speculators_compat.extraction.capture import gather_rows

    row_bytes = 96
    gen = torch.Generator().manual_seed(0)
    chunks = {3: torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=gen),
              7: torch.randint(0, 256, (2048,), dtype=torch.uint8, generator=gen)}
    located = [(7, 0), (3, 4096 - row_bytes), (3, 1), (7, 1000), (3, 64), (7, 2048 - row_bytes), (3, 1)]
    got = gather_rows(chunks, located, row_bytes)
    assert got.shape == (len(located), row_bytes)
    for k, (chunk_id, off) in enumerate(located):
        assert torch.equal(got[k], chunks[chunk_id][off:off + row_bytes]), (k, chunk_id, off)
    one = gather_rows({3: chunks[3]}, [(3, 5), (3, 0)], row_bytes)  # one chunk: the rows in the order asked
    assert torch.equal(one[0], chunks[3][5:5 + row_bytes]) and torch.equal(one[1], chunks[3][:row_bytes])


@pytest.mark.parametrize("where, match", [("past", "ends past its chunk"), ("unknown", "was not given")])
def test_a_block_outside_the_workers_chunks_is_refused_at_begin(tmp_path, where, match):
    pool = ExchangePool(str(tmp_path))
    placements, new, _ = pool.allocate_runs([[(("r0", 0), 5 * HIDDEN * 2)]])
    chunk_id, offset = placements[("r0", 0)][:2]
    size = next(c for c in new if c.id == chunk_id).ref().size
    block = (chunk_id, size - 4 * HIDDEN * 2) if where == "past" else (chunk_id + 99, offset)
    worker = SimpleNamespace(_captured_states=None, model_runner=SimpleNamespace(input_batch=SimpleNamespace(req_ids=[])))
    state = CaptureState(worker, (1,))
    state.capture = True
    with pytest.raises(ValueError, match=match):
        state.begin(Begin(call=0, caller_pid=os.getpid(), new_chunks={c.id: c.ref() for c in new},
                          live_chunks=tuple(sorted(pool.chunks)), layers=1, hidden=HIDDEN, pin=False,
                          dtype="bfloat16", check_rows=0, placements={"r0": ([block], 5)}))
    assert not state.active


def test_positions_and_token_ids_beyond_float32s_exact_range_are_read_exactly():
    """The report's one transfer back holds token ids and positions: past 2**24 a float32 would
    round 2**24 + 1 to 2**24 and report a correct row "at another position"."""
    from speculators_compat.extraction.selfcheck import RowCheck, _Sample

    far = 2**24 + 1
    check = RowCheck(2)
    sample = _Sample([("r0", far)], [0])
    sample.pos = torch.tensor([far])
    sample.ids = torch.tensor([far + 2])
    check.samples.append(sample)
    rep = check.report(lambda keys: None, {}, None, None, {})
    assert rep["positions_bad"] == [] and rep["tokens"] == [("r0", far, far + 2)], rep
    sample.pos = torch.tensor([far - 1])  # and a wrong one is still seen
    assert check.report(lambda keys: None, {}, None, None, {})["positions_bad"] == [("r0", far, far - 1)]
