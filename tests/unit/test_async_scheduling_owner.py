"""SchedulerConfig.async_scheduling has one owner: engine_config decides, both patches ask it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from speculators_compat.patches import engine_config, execution

pytestmark = pytest.mark.unit


class _Futures:
    def __init__(self, vllm_config):
        self.vllm_config = vllm_config

    def execute_model(self, scheduler_output, non_block=False):
        pass

    def sample_tokens(self, grammar_output, non_block=False):
        pass

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False, unique_reply_rank=None):
        pass


@pytest.mark.parametrize(
    "env, futures, expected",
    [
        ({}, True, True),
        ({}, False, False),
        ({"SPECULATORS_COMPAT_PIPELINE": "0"}, True, False),
        ({"SPECULATORS_COMPAT_ASYNC_SCHEDULING": "false"}, True, False),
    ],
)
def test_one_decision_from_the_settings(clean_env, env, futures, expected):
    for key, value in env.items():
        clean_env.setenv(key, value)
    assert bool(engine_config.async_scheduling_wanted(futures)) is expected


def test_the_executor_hook_writes_the_owners_decision_both_ways(clean_env):
    from speculators_compat.patches.executor import CONSTRUCTING

    config = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=False))
    ex = _Futures.__new__(_Futures)
    token = CONSTRUCTING.set(object())  # a generator being built
    try:
        execution._executor_async_scheduling(ex.__init__, ex, (), {"vllm_config": config})
        assert config.scheduler_config.async_scheduling is True
        clean_env.setenv("SPECULATORS_COMPAT_PIPELINE", "0")
        execution._executor_async_scheduling(ex.__init__, ex, (config,), {})
        assert config.scheduler_config.async_scheduling is False  # the decision, not a second writer's
    finally:
        CONSTRUCTING.reset(token)


def test_no_other_module_writes_the_field():
    """Only engine_config assigns ``.async_scheduling`` (a grep over the package's source)."""
    import pathlib
    import re

    import speculators_compat

    root = pathlib.Path(speculators_compat.__file__).parent
    writers = sorted(
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if re.search(r"\.async_scheduling\s*=(?!=)", p.read_text()) and "testing" not in p.parts
    )
    assert writers == ["patches/engine_config.py"]
