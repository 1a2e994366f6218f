"""The pipelined driver's gates: which executors it pipelines on, the env switches, and the
async-scheduling wrapper's edit of the hand-built config (signature mechanics only; the driver
itself is tested against real vLLM in tests/e2e, the probe on the real executor in tests/contract)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from _helpers import SHIPPED_MATRIX

from speculators_compat.matrix import load_matrix
from speculators_compat.patches import execution
from speculators_compat.extraction.steps import executor_takes_futures, pipeline_depth

pytestmark = pytest.mark.unit


class _FutureExecutor:  # vLLM 0.11.1+ MultiprocExecutor
    def __init__(self, vllm_config):
        self.vllm_config = vllm_config

    def execute_model(self, scheduler_output, non_block=False): ...

    def sample_tokens(self, grammar_output, non_block=False): ...

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False, unique_reply_rank=None): ...


class _BlockingExecutor:  # vLLM 0.11.0: no sample_tokens, execute_model blocks
    def __init__(self, vllm_config):
        self.vllm_config = vllm_config

    def execute_model(self, scheduler_output): ...

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False, unique_reply_rank=None): ...


def test_futures_are_read_from_the_executor_signatures():
    assert executor_takes_futures(_FutureExecutor)
    assert not executor_takes_futures(_BlockingExecutor)


def test_depth_two_with_futures_one_without_and_env_off(clean_env, monkeypatch):
    assert pipeline_depth(_FutureExecutor(None)) == 2
    assert pipeline_depth(_BlockingExecutor(None)) == 1
    monkeypatch.setenv("SPECULATORS_COMPAT_PIPELINE", "0")
    assert pipeline_depth(_FutureExecutor(None)) == 1


def _config():
    return SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=False))


def _built(cls, *args, constructing=True, **kwargs):
    """``cls(...)`` through the async-scheduling wrapper (on MultiprocExecutor.__init__), with a
    generator being built or not."""
    from speculators_compat.patches.executor import CONSTRUCTING

    ex = cls.__new__(cls)
    token = CONSTRUCTING.set(object() if constructing else None)
    try:
        execution._executor_async_scheduling(ex.__init__, ex, args, kwargs)
    finally:
        CONSTRUCTING.reset(token)
    return ex


def test_async_scheduling_turned_on_for_a_futures_executor(clean_env):
    config = _config()
    ex = _built(_FutureExecutor, vllm_config=config)
    assert config.scheduler_config.async_scheduling is True
    assert ex.vllm_config is config


def test_async_scheduling_untouched_outside_the_generators_construction(clean_env):
    config = _config()
    _built(_FutureExecutor, config, constructing=False)  # e.g. a vLLM engine the user builds beside it
    assert config.scheduler_config.async_scheduling is False


@pytest.mark.parametrize("env", ["SPECULATORS_COMPAT_ASYNC_SCHEDULING", "SPECULATORS_COMPAT_PIPELINE"])
def test_async_scheduling_left_off_by_either_switch(clean_env, monkeypatch, env):
    monkeypatch.setenv(env, "0")
    config = _config()
    _built(_FutureExecutor, config)
    assert config.scheduler_config.async_scheduling is False


def test_async_scheduling_left_off_for_a_blocking_executor(clean_env):
    config = _config()
    _built(_BlockingExecutor, vllm_config=config)
    assert config.scheduler_config.async_scheduling is False


@pytest.mark.parametrize("vllm, applies", [("0.11.0", False), ("0.11.1", True), ("0.24.0", True), ("0.32.0", True)])
def test_shipped_range(vllm, applies):
    patch = load_matrix(SHIPPED_MATRIX).patches["async-scheduling"]
    assert (patch.gate({"speculators": "0.3.0", "vllm": vllm}) is None) is applies
