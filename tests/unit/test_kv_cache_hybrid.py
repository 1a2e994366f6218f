"""kv-cache-hybrid-unify / kv-cache-hybrid-groups: the mechanics of the two wrappers and their probes
on stand-in modules (the claim that hybrid models run on vLLM rests on the real e2e cells:
benchmarks/results/arch/*qwen3_5.json, *qwen3_next.json)."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import pytest
import yaml

from _helpers import SHIPPED_MATRIX
from speculators_compat.patches import kv_cache_hybrid as kh
from speculators_compat.patches._signatures import GENERATOR
from speculators_compat.patches.executor import CONSTRUCTING

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int = 16
    by_block_stride: bool = False  # vLLM 0.24: AttentionSpec.indexes_kv_by_block_stride, per backend


@dataclass(frozen=True)
class SlidingWindowSpec:
    block_size: int = 16


@dataclass(frozen=True)
class MambaSpec:
    block_size: int = 16


@pytest.fixture
def vllm(monkeypatch):
    """Stand-in vLLM modules (0.32 layout) and speculators' generator module; returns the calls seen."""
    calls: list = []
    kcu = types.ModuleType(kh.KV_UTILS)
    kcu.is_kv_cache_spec_uniform = lambda kv_cache_spec: len(set(kv_cache_spec.values())) == 1

    def get_kv_cache_groups(vllm_config, kv_cache_spec):
        calls.append(("get_kv_cache_groups", vllm_config, dict(kv_cache_spec)))
        return ["groups by vLLM's planner"]

    kcu.get_kv_cache_groups = get_kv_cache_groups
    iface = types.ModuleType(kh.SPECS)
    iface.MambaSpec = MambaSpec
    gen = types.ModuleType(GENERATOR)

    def unify_hybrid_kv_cache_specs(kv_cache_spec):
        calls.append(("unify", dict(kv_cache_spec)))
        if any(isinstance(s, MambaSpec) for s in kv_cache_spec.values()):
            raise ValueError("Failed to promote local KV cache specs to one unified type")
        kv_cache_spec.update({k: s if isinstance(s, FullAttentionSpec) else FullAttentionSpec()
                              for k, s in kv_cache_spec.items()})

    def _get_kv_cache_groups_uniform_spec(kv_cache_spec):
        calls.append(("uniform_groups", dict(kv_cache_spec)))
        if len(set(kv_cache_spec.values())) > 1:
            raise AssertionError("All layers in the same KV cache group must be the same")
        return ["one uniform group"]

    class VllmHiddenStatesGenerator:
        def __init__(self, specs):
            token = CONSTRUCTING.set(self)  # as generator-construction does around speculators' __init__
            try:
                self.vllm_config = "the generator's VllmConfig"
                kh_unify(specs)
                self.groups = kh_groups(specs)
            finally:
                CONSTRUCTING.reset(token)

    gen.unify_hybrid_kv_cache_specs = unify_hybrid_kv_cache_specs
    gen._get_kv_cache_groups_uniform_spec = _get_kv_cache_groups_uniform_spec
    gen.VllmHiddenStatesGenerator = VllmHiddenStatesGenerator
    for name in ("vllm", "vllm.v1", "vllm.v1.core", "speculators", "speculators.data_generation"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, kh.KV_UTILS, kcu)
    monkeypatch.setitem(sys.modules, kh.SPECS, iface)
    monkeypatch.setitem(sys.modules, GENERATOR, gen)
    monkeypatch.delitem(sys.modules, kh.KV_PLANNING, raising=False)

    # the generator calls the names of its module, as speculators' __init__ does; patched by build()
    unify_patch, groups_patch = kh.PATCHES
    kh_unify = unify_patch.build(gen.unify_hybrid_kv_cache_specs)
    kh_groups = groups_patch.build(gen._get_kv_cache_groups_uniform_spec)
    return types.SimpleNamespace(calls=calls, gen=gen, kcu=kcu, unify=kh_unify, groups=kh_groups)


HYBRID = {"layers.0.linear_attn": MambaSpec(), "layers.1.linear_attn": MambaSpec(),
          "layers.2.linear_attn": MambaSpec(), "layers.3.self_attn.attn": FullAttentionSpec()}


def test_uniform_model_takes_the_unchanged_calls(vllm):
    specs = {"l0": FullAttentionSpec(), "l1": FullAttentionSpec()}
    g = vllm.gen.VllmHiddenStatesGenerator(specs)
    assert g.groups == ["one uniform group"]
    assert [c[0] for c in vllm.calls] == ["unify", "uniform_groups"]


def test_sliding_plus_full_is_still_unified_by_speculators_call(vllm):
    specs = {"l0": SlidingWindowSpec(), "l1": FullAttentionSpec()}
    g = vllm.gen.VllmHiddenStatesGenerator(specs)
    assert g.groups == ["one uniform group"]  # unified to full attention, as before
    assert [c[0] for c in vllm.calls] == ["unify", "uniform_groups"]


def test_attention_specs_that_differ_after_unification_get_vllms_groups(vllm):
    """Gemma 3 on CUDA vLLM 0.24: sliding-window layers index the cache by another block stride,
    so even unified specs are not one spec and the original asserts."""
    specs = {"l0": SlidingWindowSpec(), "l1": FullAttentionSpec(by_block_stride=True)}
    with pytest.raises(AssertionError, match="must be the same"):
        vllm.gen._get_kv_cache_groups_uniform_spec({"l0": FullAttentionSpec(), "l1": FullAttentionSpec(by_block_stride=True)})
    vllm.calls.clear()
    published = dict(specs)
    g = vllm.gen.VllmHiddenStatesGenerator(specs)  # unified in place, as vLLM's function does
    assert g.groups == ["groups by vLLM's planner"]
    unified = {"l0": FullAttentionSpec(), "l1": FullAttentionSpec(by_block_stride=True)}
    assert vllm.calls == [("unify", published), ("get_kv_cache_groups", "the generator's VllmConfig", unified)]


def test_without_the_patches_a_hybrid_model_fails_as_on_vllm_032(vllm):
    with pytest.raises(ValueError, match="Failed to promote"):
        vllm.gen.unify_hybrid_kv_cache_specs(dict(HYBRID))
    with pytest.raises(AssertionError, match="must be the same"):
        vllm.gen._get_kv_cache_groups_uniform_spec(dict(HYBRID))


def test_hybrid_model_keeps_its_specs_and_gets_vllms_groups_with_the_generators_config(vllm):
    g = vllm.gen.VllmHiddenStatesGenerator(dict(HYBRID))
    assert g.groups == ["groups by vLLM's planner"]
    assert vllm.calls == [("get_kv_cache_groups", "the generator's VllmConfig", HYBRID)]


def test_hybrid_groups_outside_the_generator_say_what_is_missing(vllm):
    with pytest.raises(RuntimeError, match="VllmHiddenStatesGenerator.__init__"):
        vllm.groups(dict(HYBRID))


def test_groups_come_from_kv_cache_planning_where_vllm_moved_them(vllm, monkeypatch):
    planning = types.ModuleType(kh.KV_PLANNING)
    planning.get_kv_cache_groups = vllm.kcu.get_kv_cache_groups
    planning.is_kv_cache_spec_uniform = vllm.kcu.is_kv_cache_spec_uniform
    del vllm.kcu.get_kv_cache_groups, vllm.kcu.is_kv_cache_spec_uniform
    monkeypatch.setitem(sys.modules, kh.KV_PLANNING, planning)
    assert kh._probe_groups(vllm.gen._get_kv_cache_groups_uniform_spec) is None
    g = vllm.gen.VllmHiddenStatesGenerator(dict(HYBRID))
    assert g.groups == ["groups by vLLM's planner"]


def test_probes_pass_on_the_032_layout(vllm):
    assert kh._probe_unify(vllm.gen.unify_hybrid_kv_cache_specs) is None
    assert kh._probe_groups(vllm.gen._get_kv_cache_groups_uniform_spec) is None


def test_probe_names_expected_and_found_signature(vllm):
    vllm.kcu.get_kv_cache_groups = lambda kv_cache_spec: None  # a changed signature
    problem = kh._probe_groups(vllm.gen._get_kv_cache_groups_uniform_spec)
    assert problem and "get_kv_cache_groups(vllm_config, kv_cache_spec)" in problem
    assert "found" in problem and "(kv_cache_spec)" in problem


def test_probe_without_mamba_spec_says_so(vllm):
    del sys.modules[kh.SPECS].MambaSpec
    problem = kh._probe_unify(vllm.gen.unify_hybrid_kv_cache_specs)
    assert problem and "expected vllm.v1.kv_cache_interface.MambaSpec" in problem


def test_shipped_matrix_gates_both_and_groups_requires_unify():
    patches = yaml.safe_load(SHIPPED_MATRIX.read_text())["patches"]
    assert {p.id: p.requires for p in kh.PATCHES}["kv-cache-hybrid-groups"] == ("kv-cache-hybrid-unify", "generator-construction")
    for pid in ("kv-cache-hybrid-unify", "kv-cache-hybrid-groups"):
        assert patches[pid]["speculators"] == ">=0.3.0,<0.5"
    ids = {p.id for p in kh.PATCHES}
    assert ids == {"kv-cache-hybrid-unify", "kv-cache-hybrid-groups"}
