"""executor-class owns the generator module's ``MultiprocExecutor``: the default construction is
vLLM's class untouched; pipeline stages (opt-in) build a subclass of the same class, and only
while a generator is being built (generator-construction's mark)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from speculators_compat.patches import executor

pytestmark = pytest.mark.unit


class _Multiproc:  # stands for vLLM's MultiprocExecutor: records how it was built
    def __init__(self, vllm_config):
        self.vllm_config = vllm_config


def _config(pp=1, backend=None):
    return SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=pp,
                                                           distributed_executor_backend=backend))


def _build(config, constructing=True):
    token = executor.CONSTRUCTING.set(object() if constructing else None)
    try:
        return executor._executor_class(_Multiproc, None, (), {"vllm_config": config})
    finally:
        executor.CONSTRUCTING.reset(token)


def test_default_is_vllms_class_itself(clean_env):
    built = _build(_config())
    assert type(built) is _Multiproc


def test_pipeline_stages_build_a_subclass_while_a_generator_is_built(clean_env):
    clean_env.setenv("SPECULATORS_COMPAT_PIPELINE_PARALLEL_SIZE", "2")
    config = _config(pp=2)
    built = _build(config)
    assert isinstance(built, _Multiproc) and type(built) is not _Multiproc
    assert type(built).__qualname__ == "PipelineStages[_Multiproc]" and built.vllm_config is config


def test_outside_the_generators_construction_nothing_changes(clean_env):
    clean_env.setenv("SPECULATORS_COMPAT_PIPELINE_PARALLEL_SIZE", "2")
    assert type(_build(_config(pp=2), constructing=False)) is _Multiproc


def test_generator_construction_marks_the_instance_for_the_call_only():
    seen = []
    instance = object()
    executor._mark_construction(lambda: seen.append(executor.CONSTRUCTING.get()), instance, (), {})
    assert seen == [instance] and executor.CONSTRUCTING.get() is None


def test_no_function_rebuilt_with_other_globals():
    """The construction is redirected through the registry-owned name, not a copy of __init__."""
    import inspect

    assert "FunctionType" not in inspect.getsource(executor)
