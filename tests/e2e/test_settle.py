"""The second reference of ``check --model``: vLLM's own forward with the shim off, scheduled as the
generator scheduled it (``e2e_runner --settle``). On real vLLM a correct capture is bit-identical
to it in every row of every case (chunked prefill included); a wrong answer planted in the
capture (self-check off, so it reaches the comparison) is not, so "settled" cannot admit it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.rehearsal]

pytest.importorskip("vllm")
pytest.importorskip("speculators")

TIMEOUT = int(os.environ.get("SPECULATORS_COMPAT_E2E_TIMEOUT", "1200"))


def _cell(tmp_path: Path, *extra: str, env: dict | None = None) -> dict:
    out = tmp_path / "cell.json"
    proc = subprocess.run(
        [sys.executable, "-m", "speculators_compat_testbed.e2e_runner", "--arch", "llama", "--out", str(out),
         "--max-num-batched-tokens", "256", "--settle", "always", *extra],
        capture_output=True, text=True, timeout=TIMEOUT, env=dict(os.environ, **(env or {})),
    )
    assert out.exists(), f"runner wrote no result (rc {proc.returncode}); stderr tail:\n{proc.stderr[-4000:]}"
    r = json.loads(out.read_text())
    assert "error" not in r, r["error"]
    return r


def test_capture_is_bit_identical_to_the_engines_own_scheduled_forward(tmp_path):
    r = _cell(tmp_path)
    s = r["settled"]
    assert "error" not in s, s["error"]
    for name, c in s["cases"].items():
        assert c["rows"] > 0 and c["identical"] == c["rows"], (name, c)
    assert s["settled"] is True
    # the chunked case really was chunked in the reference too: some prompt over several forwards
    assert any(len(spans) > 1 for spans in s["schedule"]["chunked"]), s["schedule"]["chunked"]


def test_a_planted_shift_is_not_settled(tmp_path):
    r = _cell(tmp_path, "--plant", "shift", env={"SPECULATORS_COMPAT_SELF_CHECK_ROWS": "0"})
    assert r["planted"] == "shift" and not r["passed"]
    s = r["settled"]
    assert s["settled"] is False, s
    assert all(c["identical"] < c["rows"] for c in s["cases"].values()), s["cases"]
