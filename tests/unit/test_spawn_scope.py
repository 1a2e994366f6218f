"""worker-spawn: while the generator is built on an accelerator the workers' context is spawn;
vLLM's own answer otherwise (outside the construction, on a CPU, or where the user chose a
method); the environment is never written."""

import multiprocessing
import os

import pytest

from speculators_compat.patches import engine_options, executor


def vllm_answer():  # vLLM's get_mp_context with no reason to spawn: the default method, fork
    return multiprocessing.get_context(os.environ.get(executor.SPAWN_ENV, "fork"))


@pytest.mark.parametrize("constructing, cpu, user, expected", [
    (True, False, None, "spawn"),
    (False, False, None, "fork"),  # not the generator's workers: vLLM's answer
    (True, True, None, "fork"),  # a CPU: vLLM's own platform choice
    (True, False, "fork", "fork"),  # the user's choice is kept
    (True, False, "forkserver", "forkserver"),
])
def test_spawn_only_for_the_generators_workers_on_accelerators(monkeypatch, constructing, cpu, user, expected):
    monkeypatch.delenv(executor.SPAWN_ENV, raising=False)
    if user:
        monkeypatch.setenv(executor.SPAWN_ENV, user)
    monkeypatch.setattr(engine_options, "on_cpu", lambda: cpu)
    before = dict(os.environ)
    token = executor.CONSTRUCTING.set(object() if constructing else None)
    try:
        context = executor._spawn_context(vllm_answer, None, (), {})
    finally:
        executor.CONSTRUCTING.reset(token)
    assert context.get_start_method() == expected
    assert dict(os.environ) == before


def _module_with_starter(monkeypatch, source: str, own_globals: bool):
    """A stand-in executor module whose MultiprocExecutor._init_executor is ``source``, compiled
    in the module's own globals or in another's."""
    import sys
    import types

    module = types.ModuleType(executor.EXECUTOR)
    scope = vars(module) if own_globals else {}
    exec(source, scope)  # noqa: S102 - a two-line test function
    module.MultiprocExecutor = type("MultiprocExecutor", (), {"_init_executor": scope["_init_executor"]})
    monkeypatch.setitem(sys.modules, executor.EXECUTOR, module)


@pytest.mark.parametrize("source, own_globals, problem", [
    ("def _init_executor(self):\n    return get_mp_context()\n", True, None),
    ("def _init_executor(self):\n    return get_mp_context()\n", False, "its module's get_mp_context()"),
    ("def _init_executor(self):\n    return None\n", True, "it does not call it"),
])
def test_the_probe_wants_the_starter_to_read_the_replaced_name(monkeypatch, source, own_globals, problem):
    _module_with_starter(monkeypatch, source, own_globals)
    got = executor._probe_spawn_context(lambda: None)
    assert got is None if problem is None else problem in got
    assert "found parameters ['x']" in executor._probe_spawn_context(lambda x: None)
