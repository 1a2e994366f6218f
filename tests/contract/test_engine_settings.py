"""SPECULATORS_COMPAT_DTYPE and SPECULATORS_COMPAT_MAX_NUM_BATCHED_TOKENS reach the generator's own
hand-built VllmConfig (speculators hard-codes dtype "auto" and, in 0.3.0, the token budget)."""

import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

import speculators_compat
from speculators_compat.patches._signatures import GENERATOR


def _config(monkeypatch, **env):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    from speculators_compat_testbed import build_tiny_model

    gen = importlib.import_module(GENERATOR)
    owner = object.__new__(gen.VllmHiddenStatesGenerator)
    return gen.VllmHiddenStatesGenerator._create_vllm_config(owner, str(build_tiny_model("llama")), 2048, 0.5, 1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_dtype_setting_reaches_the_engine(monkeypatch, dtype):
    cfg = _config(monkeypatch, SPECULATORS_COMPAT_DTYPE=dtype)
    assert speculators_compat.get_registry().is_applied("engine-dtype")
    assert cfg.model_config.dtype == getattr(torch, dtype)


def test_unset_leaves_speculators_auto(monkeypatch):
    """Control: the tiny model is float32; "auto" on CPU gives what vLLM picks (not always float32),
    and the same value as with the patch reverted."""
    monkeypatch.delenv("SPECULATORS_COMPAT_DTYPE", raising=False)
    with_patch = _config(monkeypatch).model_config.dtype
    reg = speculators_compat.get_registry()
    reg.revert("engine-dtype")
    try:
        without = _config(monkeypatch).model_config.dtype
    finally:
        reg.retry("engine-dtype")
    assert with_patch == without


def test_the_token_budget_reaches_the_scheduler(monkeypatch):
    cfg = _config(monkeypatch, SPECULATORS_COMPAT_MAX_NUM_BATCHED_TOKENS="512")
    assert cfg.scheduler_config.max_num_batched_tokens == 512
    assert _config(monkeypatch, SPECULATORS_COMPAT_MAX_NUM_BATCHED_TOKENS="0").scheduler_config.max_num_batched_tokens >= 2048


def test_a_bad_budget_is_one_line(monkeypatch):
    from speculators_compat.settings import SettingError

    with pytest.raises(SettingError, match="SPECULATORS_COMPAT_MAX_NUM_BATCHED_TOKENS='many'") as info:
        _config(monkeypatch, SPECULATORS_COMPAT_MAX_NUM_BATCHED_TOKENS="many")
    assert "\n" not in str(info.value)


def test_a_bad_dtype_is_one_line(monkeypatch):
    from speculators_compat.settings import SettingError

    with pytest.raises(SettingError, match="SPECULATORS_COMPAT_DTYPE='fp32': expected one of") as info:
        _config(monkeypatch, SPECULATORS_COMPAT_DTYPE="fp32")
    assert "\n" not in str(info.value)


def test_additional_config_reaches_the_engine(monkeypatch):
    """vLLM's ``--additional-config`` (e.g. ``gdn_prefill_backend``, read by the GDN layers of
    Qwen3.5 / Qwen3-Next) reaches the hand-built VllmConfig; unset, it is vLLM's default."""
    monkeypatch.delenv("SPECULATORS_COMPAT_ADDITIONAL_CONFIG", raising=False)
    assert not _config(monkeypatch).additional_config
    cfg = _config(monkeypatch, SPECULATORS_COMPAT_ADDITIONAL_CONFIG='{"gdn_prefill_backend": "triton"}')
    assert cfg.additional_config == {"gdn_prefill_backend": "triton"}


@pytest.mark.parametrize("raw, words", [("{gdn: triton}", "expected a JSON object; found invalid JSON ("),
                                        ('["triton"]', "expected a JSON object; found list"),
                                        ("{" + "x" * 500, "...'"),  # a long value is shortened
                                        ("\x01" * 300, "...'"),  # escapes count toward the bound
                                        ("[" * 100000, "nested too deeply to read")])
def test_a_bad_additional_config_is_one_line(monkeypatch, raw, words):
    from speculators_compat.settings import SettingError

    with pytest.raises(SettingError, match="SPECULATORS_COMPAT_ADDITIONAL_CONFIG=") as info:
        _config(monkeypatch, SPECULATORS_COMPAT_ADDITIONAL_CONFIG=raw)
    assert words in str(info.value) and "\n" not in str(info.value) and len(str(info.value)) < 300


def test_the_harness_forces_the_dtype_through_the_shim_before_speculators_is_imported(tmp_path):
    """The e2e harness asks for a dtype before speculators is imported, while the shim is still
    lazy (it activates on that import). It must pass the dtype through engine-dtype, not wrap
    ModelConfig over the patch: that left engine-dtype "applied, then lost" in every forced-dtype
    cell (the hybrid H100 cells), which the tested table rightly refuses to count."""
    code = (
        "import json, sys\n"
        "import speculators_compat\n"
        "from speculators_compat_testbed import e2e_runner\n"
        f"assert {GENERATOR!r} not in sys.modules\n"
        "via = e2e_runner._force_engine_dtype('bfloat16')\n"
        "status = {s.id: s.as_dict() for s in speculators_compat.get_registry().statuses()}['engine-dtype']\n"
        "print(json.dumps({'via': via, 'status': status['status'], 'reason': status['reason']}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "SPECULATORS_COMPAT_DTYPE"}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["via"] == "SPECULATORS_COMPAT_DTYPE", found
    assert found["status"] == "applied", found
