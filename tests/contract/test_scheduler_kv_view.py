"""The scheduler the generator builds takes a KV-cache config with a uniform-type group (layers of
one attention type, different shapes: Gemma 3 on CUDA), as vLLM's engine core's scheduler does.
Real vLLM objects: the generator's own hand-built config, vLLM's grouping, vLLM's Scheduler."""

import importlib
from dataclasses import replace

import pytest
import torch

import speculators_compat
from speculators_compat.patches._signatures import GENERATOR


def _uniform_type_config(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, UniformTypeKVCacheSpecs

    from speculators_compat_testbed import build_tiny_model

    gen = importlib.import_module(GENERATOR)
    owner = object.__new__(gen.VllmHiddenStatesGenerator)
    vllm_config = gen.VllmHiddenStatesGenerator._create_vllm_config(owner, str(build_tiny_model("llama")), 2048, 0.5, 1)
    block = vllm_config.cache_config.block_size or 16
    full = FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=64, dtype=torch.float32)
    specs = {"model.layers.0.self_attn.attn": full,
             "model.layers.1.self_attn.attn": replace(full, head_size=128)}  # one type, two shapes
    groups = get_kv_cache_groups(vllm_config, specs)
    assert len(groups) == 1 and isinstance(groups[0].kv_cache_spec, UniformTypeKVCacheSpecs), groups
    vllm_config.cache_config.num_gpu_blocks = 64  # as the generator sets it from the planned config
    return gen, vllm_config, KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def _build(scheduler_cls, vllm_config, kv_cache_config, **sizes):
    from vllm.v1.structured_output import StructuredOutputManager

    return scheduler_cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                         structured_output_manager=StructuredOutputManager(vllm_config), **sizes)


def test_the_scheduler_takes_a_uniform_type_group(monkeypatch):
    gen, vllm_config, kv_cache_config = _uniform_type_config(monkeypatch)
    if not speculators_compat.get_registry().is_applied("scheduler-args"):
        pytest.skip("scheduler-args is not applied on this pair")
    scheduler = _build(gen.Scheduler, vllm_config, kv_cache_config)
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    assert [type(m).__name__ for m in managers] == ["FullAttentionManager"], managers
    # the workers' config is left whole
    assert type(kv_cache_config.kv_cache_groups[0].kv_cache_spec).__name__ == "UniformTypeKVCacheSpecs"


def test_control_vllm_scheduler_alone_has_no_manager_for_it(monkeypatch):
    """Without the engine core's view the real scheduler refuses the same config: the test above
    would fail on a wrong answer."""
    gen, vllm_config, kv_cache_config = _uniform_type_config(monkeypatch)
    from speculators_compat.patches._signatures import accepts

    original = getattr(gen.Scheduler, "__wrapped__", gen.Scheduler)
    block = vllm_config.cache_config.block_size or 16
    sizes = {k: block for k in ("block_size", "hash_block_size") if accepts(original, k)}
    with pytest.raises((KeyError, AssertionError), match="UniformTypeKVCacheSpecs"):  # 0.32: an assert
        _build(original, vllm_config, kv_cache_config, **sizes)
