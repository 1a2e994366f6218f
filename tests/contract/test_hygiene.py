"""Declared dependencies and the namespace-bound memory query, on the real installed versions."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.contract

pytest.importorskip("vllm")
pytest.importorskip("speculators")


def _versions():
    from speculators_compat.versions import installed_versions

    return {k: v.version for k, v in installed_versions().items()}


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECULATORS_COMPAT_")}
    env.update(extra)
    return env


def test_excluding_request_args_where_generate_driver_needs_it_is_one_line_at_import():
    from packaging.version import Version

    vllm = Version(_versions()["vllm"]).release
    proc = subprocess.run(
        [sys.executable, "-c", "import speculators_compat"],
        env=_env(SPECULATORS_COMPAT_PATCHES="-request-args"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if vllm < (0, 17):  # request-args is ranged out: nothing to require there
        assert proc.returncode == 0, proc.stderr
        return
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "ValueError: speculators_compat: SPECULATORS_COMPAT_PATCHES='-request-args' excludes 'request-args', "
        "which patch 'generate-driver' requires"
    ), proc.stderr
    assert "Traceback" not in proc.stderr.replace("Traceback (most recent call last):", "", 1)


def test_memory_query_torch_cuda_binds_the_generator_namespace_only():
    import torch

    import speculators.data_generation.vllm_hidden_states_generator as gen  # runs the hooks

    import speculators_compat
    from speculators_compat.patches.platform import TorchView

    status = {r["id"]: r for r in speculators_compat.report()}["memory-query-torch-cuda"]
    if _versions()["speculators"] != "0.3.0":
        assert status["status"] == "skipped" and "outside ==0.3.0" in status["reason"], status
        assert not isinstance(vars(gen).get("torch"), TorchView)
        return
    assert status["status"] == "applied", status
    assert status["target"].endswith("vllm_hidden_states_generator:torch")
    assert isinstance(vars(gen)["torch"], TorchView) and vars(gen)["torch"].__wrapped__ is torch
    # process-wide torch is untouched; the generator's view answers from the platform
    assert sys.modules["torch"] is torch and torch.cuda.mem_get_info.__module__ == "torch.cuda.memory"
    assert gen.torch.cuda.mem_get_info.__func__.__module__ == "speculators_compat.patches.platform"
    os.environ["SPECULATORS_COMPAT_KV_CACHE_BYTES"] = "1234567"
    try:
        assert gen.torch.cuda.mem_get_info() == (1234567, 1234567)
    finally:
        del os.environ["SPECULATORS_COMPAT_KV_CACHE_BYTES"]
    assert gen.torch.Tensor is torch.Tensor and gen.torch.float16 is torch.float16
