"""`speculators-compat check` against the real installed vLLM and speculators (no model)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.contract

pytest.importorskip("vllm")
pytest.importorskip("speculators")


def test_check_passes_probes_on_the_installed_vllm():
    proc = subprocess.run(
        [sys.executable, "-m", "speculators_compat", "check", "--json"], capture_output=True, text=True, timeout=900
    )
    report = json.loads(proc.stdout)
    drift = [f for f in report["findings"] if f["status"] in ("drift", "error")]
    assert proc.returncode in (0, 1), drift
    assert not drift
    assert report["exit_code"] == proc.returncode
    # every call site was probed, and the verdict matches the tested table
    sites = [f for f in report["findings"] if f["kind"] == "call-site"]
    assert len(sites) >= 20


def test_check_reports_a_removed_internal_as_drift(monkeypatch):
    from speculators_compat.check import EXIT_DRIFT, run_check
    from vllm.v1.core.sched.scheduler import Scheduler

    # renamed away: gone from the class and from the interface it inherits
    for klass in Scheduler.__mro__:
        if "update_from_output" in vars(klass):
            monkeypatch.delattr(klass, "update_from_output")
    code, out = run_check()
    assert code == EXIT_DRIFT
    drift = [f for f in out["findings"] if f.status == "drift"]
    assert any("update_from_output" in f.name and "update_from_output" in f.detail for f in drift), drift


def test_check_reports_a_resigned_internal_as_drift(monkeypatch):
    import vllm.v1.core.kv_cache_utils as kcu

    from speculators_compat.check import EXIT_DRIFT, run_check

    def get_kv_cache_config_from_groups(vllm_config, groups):  # re-signed: no available_memory
        raise AssertionError("not called by check")

    monkeypatch.setattr(kcu, "get_kv_cache_config_from_groups", get_kv_cache_config_from_groups)
    code, out = run_check()
    assert code == EXIT_DRIFT
    site = next(f for f in out["findings"] if f.name.startswith("G: kv_cache_utils.get_kv_cache_config_from_groups"))
    assert site.status == "drift"
    assert "kv_cache_groups" in site.detail and "available_memory" in site.detail


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
    site = next(f for f in out["findings"] if f.name == "G: kv_cache_utils._get_kv_cache_groups_uniform_spec")
    assert site.status == "drift" and "not found" in site.detail


def _check_with_row(tmp_path, status: str) -> tuple[int, dict]:
    """`check --json` with a copy of the shipped matrix whose row for the installed pair says ``status``."""
    import yaml

    from speculators_compat.matrix import matrix_path
    from speculators_compat.versions import installed_versions

    v = {k: x.version for k, x in installed_versions().items()}
    data = yaml.safe_load(matrix_path().read_text())
    data["tested"] = [{"speculators": v["speculators"], "vllm": v["vllm"].split("+")[0], "status": status,
                       "platform": "cpu", "evidence": f"test row ({status})", "date": "", "commit": "0" * 10}]
    path = tmp_path / f"matrix_{status}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    import os

    proc = subprocess.run([sys.executable, "-m", "speculators_compat", "check", "--json"], capture_output=True,
                          text=True, timeout=900, env={**os.environ, "SPECULATORS_COMPAT_MATRIX": str(path)})
    return proc.returncode, json.loads(proc.stdout)


def test_a_stale_row_is_untested_and_a_verified_one_supported(tmp_path):
    """A row whose results came from an earlier src/ tree ('stale') does not make the pair
    supported: exit 1. The same matrix with the row 'verified' exits 0 (the control)."""
    code, report = _check_with_row(tmp_path, "stale")
    table = [f for f in report["findings"] if f["name"] == "tested-table"]
    assert code == 1 and table and table[0]["status"] == "untested" and "stale" in table[0]["detail"], report
    code, report = _check_with_row(tmp_path, "verified")
    assert code == 0, [f for f in report["findings"] if f["status"] not in ("ok", "skipped")]
