"""`speculators-compat check` against the real installed vLLM and speculators (no model)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.contract

pytest.importorskip("vllm")
pytest.importorskip("speculators")


def test_check_passes_probes_on_the_installed_vllm(tmp_path):
    """The shipped matrix, as a user's copy whose tested table says this pair is verified here: no
    drift, exit 0. The control of the tested-table and ranged-out cases below (a user's matrix with
    the shipped ranges names no patch as left out)."""
    proc, report = _check_with_row(tmp_path, "verified")
    drift = [f for f in report["findings"] if f["status"] in ("drift", "error")]
    assert proc.returncode == 0, drift
    assert not drift
    assert report["exit_code"] == proc.returncode
    assert not [f for f in report["findings"] if "left out by" in f["detail"]]
    # every call site was probed
    sites = [f for f in report["findings"] if f["kind"] == "call-site"]
    assert len(sites) >= 20


def _in_fresh_process(script: str):
    """Run ``script`` in a new interpreter; the JSON it printed after ``RESULT ``."""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, proc.stderr[-3000:]
    return json.loads(line[len("RESULT "):])


_REMOVED_DRIVER_INTERNAL = """
import json
from vllm.v1.core.sched.scheduler import Scheduler

# renamed away: gone from the class and from the interface it inherits
removed = [(klass, vars(klass)["update_from_output"]) for klass in Scheduler.__mro__ if "update_from_output" in vars(klass)]
for klass, _ in removed:
    delattr(klass, "update_from_output")
from speculators_compat.check import run_check

code, out = run_check()
for klass, original in removed:  # restored: a second check in this process probes again
    setattr(klass, "update_from_output", original)
again, out2 = run_check()
print("RESULT " + json.dumps([code, [[f.name, f.status, f.detail] for f in out["findings"]],
                              again, [[f.name, f.status, f.detail] for f in out2["findings"] if f.status == "drift"]]))
"""


def test_check_reports_a_removed_internal_as_drift():
    # a fresh process: in one where the generator was imported before, generate-driver is
    # already applied and its probe is not run again (under pytest-xdist it depends on the files
    # a process ran first)
    from speculators_compat.check import EXIT_DRIFT

    code, findings, again, drift_again = _in_fresh_process(_REMOVED_DRIVER_INTERNAL)
    assert code == EXIT_DRIFT
    drift = [f for f in findings if f[1] == "drift"]
    # named by the patch that calls it (its probe needs it, so the patch is not applied)
    assert any(f[0] == "generate-driver" and "Scheduler.update_from_output" in f[2] for f in drift), drift
    # and by its declared call, bound although the patch failed
    assert any(f[0].startswith("patch generate-driver: ") and "update_from_output" in f[2] for f in drift), drift
    assert not drift_again, drift_again  # restored: no stale drift


_RESIGNED_DRIVER_CALL = """
import json
from vllm.v1.core.sched.scheduler import Scheduler

def update_from_output(self, scheduler_output, model_runner_output, step_stats):  # one more required
    raise AssertionError("not called by check")

Scheduler.update_from_output = update_from_output
from speculators_compat.check import run_check

code, out = run_check()
print("RESULT " + json.dumps([code, [[f.name, f.status, f.detail] for f in out["findings"]]]))
"""


def test_check_reports_a_resigned_driver_call_as_drift():
    # a fresh process: the driver's calls as imported before anything else patched them
    from speculators_compat.check import EXIT_DRIFT

    code, findings = _in_fresh_process(_RESIGNED_DRIVER_CALL)
    assert code == EXIT_DRIFT
    site = next(f for f in findings if f[1] == "drift" and "update_from_output" in f[0])
    assert site[0].startswith("patch generate-driver: ") and "step_stats" in site[2], site


def test_check_reports_a_resigned_internal_as_drift(monkeypatch):
    import vllm.v1.core.kv_cache_utils as kcu

    from speculators_compat.check import EXIT_DRIFT, run_check

    def get_kv_cache_config_from_groups(vllm_config, groups):  # re-signed: no available_memory
        raise AssertionError("not called by check")

    monkeypatch.setattr(kcu, "get_kv_cache_config_from_groups", get_kv_cache_config_from_groups)
    code, out = run_check()
    assert code == EXIT_DRIFT
    site = next(f for f in out["findings"] if "get_kv_cache_config_from_groups" in f.name and f.status == "drift")
    assert "available_memory" in site.detail and "vllm_config, groups" in site.detail


def test_check_reports_a_vllm_name_speculators_imports_as_drift(monkeypatch):
    """A release that removes a name speculators' generator imports breaks the import itself: that
    is drift (exit 2) naming the call site, not 'cannot check' (measured on vLLM 0.10.2, which
    lacks kv_cache_utils._get_kv_cache_groups_uniform_spec)."""
    import sys

    import vllm.v1.core.kv_cache_utils as kcu

    from speculators_compat.check import EXIT_DRIFT, run_check

    monkeypatch.delattr(kcu, "_get_kv_cache_groups_uniform_spec")
    for name in [m for m in sys.modules if m == "speculators.data_generation" or m.startswith("speculators.data_generation.")]:
        monkeypatch.delitem(sys.modules, name)
    code, out = run_check()
    assert code == EXIT_DRIFT
    imports = [f for f in out["findings"] if f.kind == "import"]
    assert imports and all(f.status == "drift" and "_get_kv_cache_groups_uniform_spec" in f.detail for f in imports)
    site = next(f for f in out["findings"] if f.name == "G: vllm.v1.core.kv_cache_utils._get_kv_cache_groups_uniform_spec(kv_cache_spec)")
    assert site.status == "drift" and "not found" in site.detail


def _check_with_row(tmp_path, status: str, platform: str = "cpu") -> tuple[subprocess.CompletedProcess, dict]:
    """`check --json` with a copy of the shipped matrix whose one row, for the installed pair on
    ``platform``, says ``status``: the process and its report."""
    import yaml

    from speculators_compat.matrix import matrix_path
    from speculators_compat.versions import installed_versions

    v = {k: x.version for k, x in installed_versions().items()}
    data = yaml.safe_load(matrix_path().read_text())
    data["tested"] = [{"speculators": v["speculators"], "vllm": v["vllm"].split("+")[0], "status": status,
                       "platform": platform, "evidence": f"test row ({status})", "date": "", "commit": "0" * 10}]
    path = tmp_path / f"matrix_{status}_{platform}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    import os

    proc = subprocess.run([sys.executable, "-m", "speculators_compat", "check", "--json"], capture_output=True,
                          text=True, timeout=900, env={**os.environ, "SPECULATORS_COMPAT_MATRIX": str(path)})
    assert proc.stdout.strip(), proc.stderr[-3000:]
    return proc, json.loads(proc.stdout)


def test_a_stale_row_is_untested(tmp_path):
    """A row whose results came from an earlier src/ tree ('stale') does not make the pair
    supported: exit 1 (the control, the same row 'verified', exits 0: the first test)."""
    proc, report = _check_with_row(tmp_path, "stale")
    table = [f for f in report["findings"] if f["name"] == "tested-table"]
    assert proc.returncode == 1 and table and table[0]["status"] == "untested" and "stale" in table[0]["detail"], report


def test_a_row_verified_on_another_platform_only_is_untested(tmp_path):
    """This bed's vLLM is a CPU build: a pair verified on CUDA only is untested here (exit 1), and the
    finding says where it was verified; the control (the same row on cpu) exits 0: the first test."""
    proc, report = _check_with_row(tmp_path, "verified", platform="cuda")
    table = [f for f in report["findings"] if f["name"] == "tested-table"]
    assert proc.returncode == 1 and table and table[0]["status"] == "untested", report
    assert "(cpu)" in table[0]["detail"] and "only on cuda (verified)" in table[0]["detail"], table


def _users_matrix(tmp_path, vllm_range_for: dict[str, str] | None = None, all_out: bool = False):
    import yaml

    from speculators_compat.check import _shipped_matrix_path

    data = yaml.safe_load(_shipped_matrix_path().read_text())
    for pid, entry in data["patches"].items():
        if all_out or pid in (vllm_range_for or {}):
            entry["vllm"] = (vllm_range_for or {}).get(pid, "<0.1")
    path = tmp_path / "users_matrix.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


@pytest.mark.parametrize("all_out", [False, True])
def test_a_patch_ranged_out_by_a_users_matrix_while_needed_is_drift(tmp_path, all_out):
    """#16: a matrix that ranges patches out (one, or all) must not make check say 'supported'."""
    import os

    env = {**os.environ, "SPECULATORS_COMPAT_MATRIX": _users_matrix(tmp_path, {"scheduler-args": "<0.1"}, all_out)}
    proc = subprocess.run(
        [sys.executable, "-m", "speculators_compat", "check", "--json"], capture_output=True, text=True, timeout=900, env=env
    )
    report = json.loads(proc.stdout)
    ranged = [f for f in report["findings"] if f["kind"] == "patch" and f["status"] == "drift" and "left out by" in f["detail"]]
    if all_out:
        # speculators' own import then fails (the transformers-5 patches are out): cannot check (3)
        # or drift (2), never supported; the patches left out are named
        assert proc.returncode in (2, 3), report["verdict"]
        assert ranged, report["findings"]
    else:
        assert proc.returncode == 2, report["verdict"]
        assert any(f["name"] == "scheduler-args" for f in ranged), ranged
    # the control, a user's matrix with the shipped ranges (no such finding, exit 0): the first test
