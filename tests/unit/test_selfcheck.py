"""The self-check's bookkeeping without torch: which rows a step samples, and ``judge`` on the
workers' reports (a clean report passes; each planted wrong answer fails naming the row; a
report with nothing wrong in it is not an error). The real-vLLM proof is tests/e2e/test_faults."""

from __future__ import annotations

import pytest

from speculators_compat.extraction import selfcheck
from speculators_compat.extraction.selfcheck import RowCheck, SelfCheckFailed, judge

SEQS = {"a": [5, 6, 7, 8], "b": [9, 10, 11]}


def report(**over) -> dict:
    r = {"rows": 4, "off": False, "tokens": [("a", 0, 5), ("a", 3, 8), ("b", 0, 9), ("b", 2, 11)],
         "positions_bad": [], "copies_bad": [], "final_max_rel_error": 0.004, "final_limit": 0.0625, "final_bad": [],
         "seen": {"tokens": 4, "positions": 4, "copies": 8, "final": 4}, "why_not": {}}
    r.update(over)
    return r


def test_a_clean_report_passes_and_is_counted():
    s = judge([report(), None], SEQS, [1, 3])
    assert s == {"rows": 4, "tokens_checked": 4, "positions_checked": 4, "copies_checked": 8, "final_rows": 4,
                 "final_max_rel_error": 0.004, "not_covered": []}


def test_a_kind_no_rank_saw_is_not_covered_with_the_ranks_reasons():
    # two pipeline stages: the first embeds, the last runs the final norm: everything is covered
    first = report(seen={"tokens": 4, "positions": 4, "copies": 4, "final": 0},
                   why_not={"final": "the final norm is on another pipeline stage"})
    last = report(tokens=[], seen={"tokens": 0, "positions": 4, "copies": 4, "final": 4},
                  why_not={"tokens": "no embedding on this stage"})
    assert judge([first, last], SEQS, [1, 3])["not_covered"] == []
    # one stage that saw no final norm, and a hook that never fired
    alone = report(seen={"tokens": 4, "positions": 0, "copies": 8, "final": 0},
                   why_not={"final": "layer 3 not captured"})
    assert judge([alone], SEQS, [1, 2])["not_covered"] == [
        "positions (no sampled row reached it)", "final norm (layer 3 not captured)"]
    assert judge([report(off=True, rows=0, tokens=[])], SEQS, [1])["not_covered"] == [
        "off (SPECULATORS_COMPAT_SELF_CHECK_ROWS=0)"]


@pytest.mark.parametrize("over, words", [
    ({"tokens": [("a", 0, 5), ("b", 0, 6)]}, "row 0 of b was computed for token 6; expected 9"),
    ({"positions_bad": [("a", 3, 2)]}, "row 3 of a was computed at position 2"),
    ({"copies_bad": [("b", 2, 3)]}, "row 2 of b, layer 3"),
    ({"final_bad": [("a", 1, 1.38)]}, "row 1 of a, relative error 1.38 (limit 0.0625)"),
    ({"final_bad": [("a", 1, float("nan"))]}, "row 1 of a, a non-finite row"),
    ({"final_bad": [("a", 1, float("nan"), True, False)]}, "row 1 of a, a non-finite row"),
    ({"final_bad": [("b", 2, float("nan"), False, False)]},
     "model's own final-norm output is non-finite (NaN/inf computed by the engine, not misplaced by the capture): "
     "row 2 of b"),
])
def test_each_wrong_answer_fails_naming_its_row(over, words):
    with pytest.raises(SelfCheckFailed) as e:
        judge([report(**over)], SEQS, [1, 3])
    assert words in str(e.value) and "SPECULATORS_COMPAT_SELF_CHECK_ROWS=0" in str(e.value)
    assert str(e.value).splitlines()[0].startswith("speculators-compat self-check failed (layers [1, 3])")


def test_pick_takes_first_and_last_rows_of_spread_sequences():
    rc = RowCheck(4)  # two sequences per sampled step
    spans = [(0, "a", 0, 4), (4, "b", 0, 3), (7, "c", 2, 1), (8, "d", 0, 5)]
    s = rc.pick(spans)
    assert s.meta == [("a", 0), ("a", 3), ("c", 2)] and s.src == [0, 3, 7]  # c: one row, once
    s = rc.pick(spans)  # the next step starts one sequence later
    assert [m[0] for m in s.meta] == ["b", "b", "d", "d"] and s.src == [4, 6, 8, 12]


def test_pick_samples_early_steps_and_powers_of_two_only():
    rc = RowCheck(2)
    taken = [rc.pick([(0, "a", k, 1)]) is not None for k in range(20)]
    assert [k for k, t in enumerate(taken) if t] == [0, 1, 2, 3, 4, 8, 16]
    assert RowCheck(0).pick([(0, "a", 0, 1)]) is None  # off


def test_final_norm_found_only_where_this_stage_runs_it():
    class Base:
        norm = staticmethod(lambda x: x)

    assert selfcheck.final_norm_of(Base(), 4, 4)[0] is not None
    assert selfcheck.final_norm_of(Base(), 4, 2) == (None, "the final norm is on another pipeline stage")
    assert "has none of norm" in selfcheck.final_norm_of(object(), 4, 4)[1]


def test_positions_index_reads_the_layer_signature():
    class Llama:
        def forward(self, positions, hidden_states, residual): ...

    class GptOss:
        def forward(self, hidden_states, positions, residual=None): ...

    class NoPositions:
        def forward(self, hidden_states, residual): ...

    assert selfcheck.positions_index(Llama) == 0
    assert selfcheck.positions_index(GptOss) == 1
    assert selfcheck.positions_index(NoPositions) is None
