"""PP on the Ray executor: each rank's KV-cache config keeps only its own layers' groups and
tensors (executor.per_rank_configs; a pure function over vLLM's config dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from speculators_compat.patches.executor import per_rank_configs

pytestmark = pytest.mark.unit


@dataclass
class Group:
    layer_names: list
    spec: str = "full"


@dataclass
class Tensor:
    shared_by: list
    size: int = 1


@dataclass
class Config:
    num_blocks: int
    kv_cache_groups: list = field(default_factory=list)
    kv_cache_tensors: list = field(default_factory=list)


def test_each_rank_keeps_only_its_layers():
    config = Config(
        7,
        [Group(["l0", "l1", "l2", "l3"]), Group(["l4"], "sliding")],
        [Tensor(["l0", "l2"]), Tensor(["l1", "l3"]), Tensor(["l4"])],
    )
    first, second = per_rank_configs(config, [{"l0": 0, "l1": 0}, {"l2": 0, "l3": 0, "l4": 0}])
    assert [g.layer_names for g in first.kv_cache_groups] == [["l0", "l1"]]
    assert [t.shared_by for t in first.kv_cache_tensors] == [["l0"], ["l1"]]
    assert [(g.layer_names, g.spec) for g in second.kv_cache_groups] == [(["l2", "l3"], "full"), (["l4"], "sliding")]
    assert [t.shared_by for t in second.kv_cache_tensors] == [["l2"], ["l3"], ["l4"]]
    assert first.num_blocks == second.num_blocks == 7
    # the input is not modified
    assert config.kv_cache_groups[0].layer_names == ["l0", "l1", "l2", "l3"]
    assert config.kv_cache_tensors[0].shared_by == ["l0", "l2"]


def test_the_pipeline_stages_subclass_merges_specs_and_splits_configs():
    """executor.pipeline_stages: a subclass (no instance attribute assigned over a method): rank 0
    answers get_kv_cache_spec for every stage; each rank then gets the config of its own layers."""
    from types import SimpleNamespace

    from speculators_compat.patches.executor import pipeline_stages

    class Executor:  # stands in for MultiprocExecutor / RayExecutorV2
        def __init__(self, vllm_config):
            self.vllm_config = vllm_config
            self.initialized = None

        def collective_rpc(self, method, timeout=None, args=()):
            return [{"l0": "s", "l1": "s"}, {"l2": "s", "l3": "s"}] if method == "get_kv_cache_spec" else [method, args]

        def initialize_from_config(self, kv_cache_configs):
            self.initialized = kv_cache_configs

    cls = pipeline_stages(Executor)
    assert issubclass(cls, Executor)
    ex = cls(vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(world_size=2)))
    assert ex.collective_rpc("get_kv_cache_spec") == [{"l0": "s", "l1": "s", "l2": "s", "l3": "s"}, {"l2": "s", "l3": "s"}]
    assert ex.collective_rpc("other", args=(1,)) == ["other", (1,)]
    ex.initialize_from_config([Config(3, [Group(["l0", "l1", "l2", "l3"])], [Tensor(["l0", "l2"])])])
    assert [[g.layer_names for g in c.kv_cache_groups] for c in ex.initialized] == [[["l0", "l1"]], [["l2", "l3"]]]
    assert "collective_rpc" not in vars(ex) and "initialize_from_config" not in vars(ex)
    plain = Executor(vllm_config=None)
    assert plain.collective_rpc("get_kv_cache_spec")[0] == {"l0": "s", "l1": "s"}  # the base class is untouched
