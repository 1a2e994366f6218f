"""executor-class starts the generator's workers with spawn on accelerators for the construction
only, and leaves a user's choice alone."""

import pytest

from speculators_compat.patches import engine_options, executor


@pytest.mark.parametrize("cpu", [False, True])
def test_spawn_is_set_for_the_construction_only(monkeypatch, cpu):
    monkeypatch.delenv(executor.SPAWN_ENV, raising=False)
    monkeypatch.setattr(engine_options, "on_cpu", lambda: cpu)
    undo = executor._spawn_workers_on_accelerators()
    import os

    assert os.environ.get(executor.SPAWN_ENV) == (None if cpu else "spawn")
    undo()
    assert executor.SPAWN_ENV not in os.environ


def test_a_users_method_is_kept(monkeypatch):
    import os

    monkeypatch.setenv(executor.SPAWN_ENV, "fork")
    monkeypatch.setattr(engine_options, "on_cpu", lambda: False)
    executor._spawn_workers_on_accelerators()()
    assert os.environ[executor.SPAWN_ENV] == "fork"
