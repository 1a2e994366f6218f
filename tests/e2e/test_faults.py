"""Bad input gets a one-line error and loses nothing; a vLLM worker killed in the middle of ``generate`` (real processes, real vLLM): the caller gets
a named error within the RPC bound, and no vLLM process is left behind."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

pytest.importorskip("vllm")
pytest.importorskip("speculators")

BOUND_S = 60


def test_worker_killed_mid_extraction(tmp_path):
    out = tmp_path / "fault.json"
    proc = subprocess.run(
        [sys.executable, "-m", "speculators_compat.testing.fault_runner", "--out", str(out), "--timeout", str(BOUND_S)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert out.exists(), f"fault runner wrote no result (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    r = json.loads(out.read_text())
    assert r["warm_call_ok"]
    for name, err in r["bad_input"].items():
        assert err is not None, f"{name}: generate() accepted it"
        assert err["type"] == "ValueError" and "\n" not in err["message"] and err["message"], (name, err)
    assert r["after_bad_input_identical"], "a good call after bad input gave different states"
    assert r["killed"], "no worker process was found to kill"
    err = r["error"]
    assert err is not None, "generate() returned although its worker was killed"
    assert err["type"] == "ExtractionError", err
    # names what happened and where: the engine step, the dead worker and its signal, the context
    assert "engine step 2 failed" in err["message"] or "worker RPC" in err["message"], err["message"]
    assert "killed by SIGKILL" in err["message"], err["message"]
    assert "speculators-compat" in err["message"], err["message"]
    assert r["seconds_to_error"] < BOUND_S + 30, r["seconds_to_error"]
    assert r["workers_alive_after_error"] == [], r["workers_alive_after_error"]
    assert r["orphans_after_shutdown"] == [], r["orphans_after_shutdown"]
