"""The speculators-script patches on the real speculators and vLLM of the bed (no model run).

The e2e proof is tests/e2e/test_script.py (speculators' script completes on CPU); these check each
patch's decision on the real objects, and that speculators' unpatched code fails where it did.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.contract

pytest.importorskip("vllm")
pytest.importorskip("speculators")

import torch  # noqa: E402

import speculators_compat  # noqa: E402

GEN = "speculators.data_generation.vllm_hidden_states_generator"
no_device = pytest.mark.skipif(torch.accelerator.device_count() != 0, reason="asserts the no-accelerator case")


def _status(pid: str) -> str:
    return {r["id"]: r["status"] for r in speculators_compat.report()}[pid]


@pytest.fixture(scope="module")
def generator_cls():
    import importlib

    module = importlib.import_module(GEN)
    assert _status("script-tp-default") == "applied"
    return module.VllmHiddenStatesGenerator


@no_device
def test_tp_zero_without_devices_gets_the_fixing_subclass_only(generator_cls):
    fixing = generator_cls.__new__(generator_cls, "model", tensor_parallel_size=0)
    assert type(fixing) is not generator_cls and isinstance(fixing, generator_cls)
    assert type(fixing).__name__ == generator_cls.__name__
    for args, kwargs in [(("model",), {}), (("model",), {"tensor_parallel_size": 1}),
                         (("model", None, 2048, 0.8, 2), {})]:
        assert type(generator_cls.__new__(generator_cls, *args, **kwargs)) is generator_cls


@no_device
def test_the_fixing_subclass_passes_one_to_speculators(generator_cls, monkeypatch):
    seen = {}

    def fake_init(self, model_path, layer_ids=None, max_model_len=2048, gpu_memory_utilization=0.8,
                  tensor_parallel_size=1, max_num_batched_tokens=None):
        seen["tp"] = tensor_parallel_size

    monkeypatch.setattr(generator_cls, "__init__", fake_init)
    generator_cls("model", tensor_parallel_size=0)
    assert seen["tp"] == 1
    generator_cls("model", None, 2048, 0.8, 0)  # positional, as well
    assert seen["tp"] == 1
    generator_cls("model", tensor_parallel_size=3)
    assert seen["tp"] == 3


@no_device
def test_unpatched_tp_zero_fails_in_vllm():
    """What speculators' script hits without the patch: vLLM rejects tensor_parallel_size=0
    (validated from 0.17 on); earlier releases (0.16) accept it and build a world of 0 workers,
    which no engine can run on."""
    from vllm.config import ParallelConfig

    try:
        config = ParallelConfig(tensor_parallel_size=0)
    except Exception as exc:  # noqa: BLE001 - pydantic's or vLLM's own validation error
        assert "tensor_parallel_size" in str(exc) or "greater" in str(exc), exc
    else:
        assert config.world_size == 0, config.world_size


@no_device
def test_device_name_without_a_device():
    import importlib

    module = importlib.import_module("speculators.data_generation.config_generator")
    if _status("device-name-no-accelerator") == "skipped":  # 0.3.0 asks torch.cuda.is_available()
        assert module._get_gpu_info() == "CPU only"
        return
    assert _status("device-name-no-accelerator") == "applied"
    assert module.get_device_name(0) == "NO ACCELERATOR"
    assert module._get_gpu_info() == "CPU ONLY"
    if torch.accelerator.current_accelerator() is not None:  # a CUDA build of torch, no GPU
        with pytest.raises(Exception):
            module.get_device_name.__wrapped__(0)  # speculators' own: "Found no NVIDIA driver"


def test_del_drops_only_attribute_error(generator_cls):
    gen = object.__new__(generator_cls)

    class Executor:
        def __init__(self, exc):
            self.exc = exc

        def shutdown(self):
            raise self.exc

    import speculators.data_generation.vllm_hidden_states_generator as module

    gen.executor = Executor(RuntimeError("boom"))
    saved = module.log
    module.log = None  # as at interpreter exit: speculators' except branch then raises AttributeError
    try:
        gen.__del__()  # no exception
        with pytest.raises(AttributeError):
            generator_cls.__del__.__wrapped__(gen)  # speculators' own __del__
    finally:
        module.log = saved
    del gen.executor
