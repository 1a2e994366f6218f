"""scripts/update_tested.py: what counts as evidence, and the committed table agrees with it.

The cells here are result dicts shaped like e2e_runner's JSON (the table's mechanics; whether a
capture is right is decided by the runner against HF, tested in tests/contract and tests/e2e).
"""

from __future__ import annotations

import copy
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("update_tested", ROOT / "scripts" / "update_tested.py")
ut = importlib.util.module_from_spec(_spec)
sys.modules["update_tested"] = ut
_spec.loader.exec_module(ut)

TREE = "a" * 40


def good(arch="llama", tree=TREE, **prov):
    case = lambda lin: {  # noqa: E731
        "lengths_in": lin, "lengths_out": [min(n, 2047) for n in lin],
        "lengths_expected": [min(n, 2047) for n in lin], "passed": True, "shapes_ok": True,
        "max_error": 1.2e-2, "tolerance": 3e-2, "worst_row": {"sequence": 0, "layer": 3, "row": 5, "error": 2e-2},
    }
    return {
        "provenance": {"commit": "c" * 40, "dirty": False, "src_tree": tree, "matrix_sha256": "0" * 64,
                       "date_utc": "2026-12-01T03:00:00Z", "command": "python -m x", "host": "h", **prov},
        "arch": arch, "platform": "cpu", "versions": {"speculators": "0.4.0.1", "vllm": "0.32.0+cpu"},
        "unpatched": False, "dtype": "bfloat16", "max_model_len": 2048,
        "cases": {"mixed": case([40, 7]), "chunked": case([700, 800]), "truncated": case([2098, 12]),
                  "repeat": {"identical": True}},
        "worker": {"captures": True, "patches": [{"id": "worker-capture-hooks", "status": "applied"},
                                                 {"id": "worker-capture-rpc", "status": "applied"}]},
        "passed": True,
    }


def status(*datas, tree=TREE):
    cells = [ut.Cell(Path(f"spec-x_{i}_{d['arch']}.json"), d) for i, d in enumerate(datas)]
    rows = ut.rows_from(ut.group(cells), tree)
    assert len(rows) == 1
    return rows[0]


def test_both_archs_at_head_verified():
    row = status(good("llama"), good("qwen3"))
    assert row["status"] == "verified", row
    assert row["commit"] == "c" * 10 and row["date"] == "2026-12-01"
    assert "worst row 2.0e-02" in row["evidence"]


def test_bare_passed_json_is_not_evidence():
    bare = {"arch": "llama", "versions": {"speculators": "0.4.0.1", "vllm": "0.32.0"}, "unpatched": False,
            "passed": True}
    row = status(bare, {**bare, "arch": "qwen3"})
    assert row["status"] == "stale" and "no provenance" in row["evidence"]


def test_one_arch_missing_at_head_is_stale():
    assert status(good("llama"))["status"] == "stale"


@pytest.mark.parametrize("prov", [{"dirty": True}, {"dirty": None}, {"commit": None}])
def test_dirty_or_unknown_provenance_is_stale(prov):
    row = status(good("llama", **prov), good("qwen3"))
    assert row["status"] == "stale", row


def test_older_src_tree_is_stale_with_its_commit():
    row = status(good("llama", tree="b" * 40), good("qwen3", tree="b" * 40))
    assert row["status"] == "stale" and row["commit"] == "c" * 10
    assert "src changed since" in row["evidence"]


def _broken(mutate):
    d = good("llama")
    mutate(d)
    return status(d, good("qwen3"))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["cases"].pop("chunked"),  # a case missing
        lambda d: d["cases"]["mixed"]["lengths_out"].pop(),  # one sequence lost (zip would not notice)
        lambda d: d["cases"]["truncated"]["lengths_out"].__setitem__(0, 2046),  # one row short
    ],
)
def test_incomplete_results_do_not_count(mutate):
    assert _broken(mutate)["status"] == "stale"


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(passed=False),  # the runner's own verdict, even with err under today's tolerance
        lambda d: d["cases"]["repeat"].update(identical=False),
        lambda d: d["worker"]["patches"][0].update(status="failed"),
        lambda d: d.update(worker={"error": "RuntimeError: rpc"}),
        lambda d: d["cases"]["mixed"].update(passed=False),
        lambda d: d.update(error={"type": "RuntimeError", "message": "engine died"}, cases={}),
    ],
)
def test_failures_at_head_are_broken_never_rejudged(mutate):
    row = _broken(mutate)
    assert row["status"] == "broken", row


def test_a_settled_variant_is_named_settled_and_an_unsettled_one_a_mismatch():
    failing = good("deepseek_v3")
    failing["passed"] = False
    failing["cases"]["chunked"].update(passed=False, max_error=4.7e-2)
    settled = copy.deepcopy(failing)
    settled["settled"] = {"settled": True, "cases": {"mixed": {"rows": 10, "identical": 10},
                                                     "chunked": {"rows": 30, "identical": 30}}}
    unsettled = copy.deepcopy(failing)
    unsettled["settled"] = {"settled": False, "cases": {"chunked": {"rows": 30, "identical": 29}}}
    line = ut.Cell(Path("s.json"), settled).error_line(200)
    assert "every one of 40 rows bit-identical" in line and "mismatch" not in line, line
    miscounted = copy.deepcopy(settled)  # the flag alone is not taken: every case's rows must all agree
    miscounted["settled"]["cases"]["chunked"]["identical"] = 29
    for data in (failing, unsettled, miscounted):
        line = ut.Cell(Path("u.json"), data).error_line(200)
        assert line.startswith("mismatch vs HF (chunked"), line


def test_a_cell_whose_rows_pass_but_a_patch_was_lost_is_not_called_a_mismatch():
    """Rows right, a patch record failed (the H100 hybrid cells: engine-dtype applied, then lost):
    not counted, and the line names the patch, not a row mismatch."""
    data = good("qwen3_5")
    data["patches"] = [{"id": "engine-dtype", "status": "failed", "reason": "applied, then lost"}]
    cell = ut.Cell(Path("e2e_spec-0.4.0.1_qwen3_5.json"), data)
    line = cell.error_line(200)
    assert not cell.passed, line
    assert line == "patch(es) failed (probe, or applied then lost): engine-dtype", line


def test_committed_table_agrees_with_committed_results():
    """`update_tested.py --check` on this checkout (also run by `make unit`)."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "update_tested.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_stale_is_a_valid_status_and_not_supported(tmp_path):
    import yaml

    from speculators_compat.matrix import load_matrix

    data = yaml.safe_load((ROOT / "compat_matrix.yaml").read_text())
    data["tested"] = [{"speculators": "0.4.0.1", "vllm": "0.32.0", "status": "stale", "platform": "cpu",
                       "evidence": "e", "date": "", "commit": "abc"}]
    p = tmp_path / "m.yaml"
    p.write_text(yaml.safe_dump(copy.deepcopy(data)))
    m = load_matrix(p)
    rows = m.tested_status("0.4.0.1", "0.32.0")
    assert [r.status for r in rows] == ["stale"] and rows[0].commit == "abc"
    # check's exit code for a stale row: tests/contract/test_check.py (needs the real vLLM)
