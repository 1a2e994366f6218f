"""The pipelined driver's gates on the real installed vLLM (no model)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.contract

pytest.importorskip("vllm")
pytest.importorskip("speculators")


def test_the_real_executor_takes_futures():
    from packaging.version import Version
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    from speculators_compat.patches.execution import executor_takes_futures
    from speculators_compat.versions import installed_versions

    vllm = Version(installed_versions()["vllm"].version).release
    assert executor_takes_futures(MultiprocExecutor) is (vllm >= (0, 11, 1))


def test_async_scheduling_is_not_needed_on_cpu_and_reported():
    import speculators.data_generation.vllm_hidden_states_generator  # noqa: F401  (runs the hooks)
    from vllm.platforms import current_platform

    import speculators_compat

    if not current_platform.is_cpu():
        pytest.skip("CPU platform only")
    status = {r["id"]: r for r in speculators_compat.report()}["async-scheduling"]
    assert status["status"] == "skipped", status
    assert "CPU" in status["reason"] or "outside" in status["reason"], status
