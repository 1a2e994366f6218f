"""``speculators-compat check --model``: the user's config (a released one) rehearsed on real vLLM
and speculators, as a user runs it; and with the patch the architecture needs left out, it fails
loudly (exit 2, the failure named), and the second reference (vLLM's own forward scheduled as
the generator) does not rescue it, so the pass above means something."""

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

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "released_configs"


def _check(tmp_path, slug: str, *extra: str, patches: str | None = None) -> tuple[int, dict, str]:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    if patches is not None:
        env["SPECULATORS_COMPAT_PATCHES"] = patches
    proc = subprocess.run([sys.executable, "-m", "speculators_compat", "check", "--model", str(CONFIGS / slug),
                           "--json", *extra], capture_output=True, text=True, env=env, timeout=1200, cwd=tmp_path)
    try:
        return proc.returncode, json.loads(proc.stdout), proc.stderr
    except ValueError:
        return proc.returncode, {}, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_llama_3_1_8b_config_rehearses_and_passes(tmp_path):
    rc, r, err = _check(tmp_path, "llama-3.1-8b-instruct", "--layer-ids", "2,16,29,31", "--max-model-len", "8192")
    assert rc == 0, (r.get("failure"), err)
    assert r["verdict"] == "pass" and r["published_layers"] == 32 and r["shrunk_layers"] == 4
    assert r["shrunk_layer_ids"] == [0, 1, 2, 3]
    assert all(r["cases"][c]["passed"] for c in ("mixed", "chunked", "truncated")) and r["cases"]["repeat"]["identical"]
    assert "worker-capture-hooks" in r["patches"]
    assert any("max-model-len 8192 rehearsed at 2048" in n for n in r["notes"])


def test_mistral_without_engine_options_fails_loudly(tmp_path):
    """Mistral's sliding window (shrunk to 128, below the long prompts) reaches speculators' engine
    only through engine-options: left out, rows past the window differ and the rehearsal says so."""
    rc, r, err = _check(tmp_path, "mistral-7b-v0.1", patches="-engine-options")
    assert rc == 2, (r, err)
    assert r["verdict"] == "fail" and r["failure"]["message"], r
    assert str(r["failure"]["where"]).startswith("captured rows vs"), r  # the rows differ, not a crash
    assert "engine-options" not in r["patches"]
    # vLLM's own forward (shim off, scheduled as the generator) applies the window: it does not
    # settle the disagreement, and the failure says how many rows differ from it
    assert r["settled"]["settled"] is False and "error" not in r["settled"], r["settled"]
    assert any(c["identical"] < c["rows"] for c in r["settled"]["cases"].values()), r["settled"]["cases"]
    assert "rows bit-identical" in r["failure"]["own_forward"]


def test_bad_layer_id_is_one_line_before_any_engine(tmp_path):
    rc, r, err = _check(tmp_path, "llama-3.1-8b-instruct", "--layer-ids", "2,40")
    assert rc == 3 and r == {}
    assert err.strip().count("\n") == 0 and "layer id 40 is outside the model's 32 layers" in err
