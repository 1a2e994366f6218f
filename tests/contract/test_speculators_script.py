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
        with pytest.raises(Exception):  # noqa: B017 - torch's own error type varies by release
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


# -- script-resumable-output: its probe on the released scripts, and on near misses -----------


def _released_script_globals(tag: str) -> dict:
    """The released script's module namespace, as its main() sees it (its top level run, main() not)."""
    import runpy
    from pathlib import Path

    from vllm import envs

    path = Path(__file__).resolve().parents[1] / "e2e" / "speculators_scripts" / tag / "data_generation_offline.py"
    before = dict(vars(envs))
    try:
        return runpy.run_path(str(path), run_name="speculators_script_probe")
    finally:  # 0.4.x sets envs.VLLM_WORKER_MULTIPROC_METHOD at its top level: not for later tests
        for key in set(vars(envs)) - set(before):
            delattr(envs, key)
        for key, value in before.items():
            setattr(envs, key, value)


def _this_release_tag() -> str:
    from importlib.metadata import version

    return "v0.3.0" if version("speculators") == "0.3.0" else "v0.4.0.1"


def test_the_released_script_passes_the_output_probe_and_near_misses_do_not():
    from speculators_compat.patches.speculators_script import _build_resumable, _probe_script
    from speculators_compat.registry import MISSING, NotNeeded

    g = _released_script_globals(_this_release_tag())
    real = g["generate_and_save_hidden_states"]
    assert _probe_script(real) is None
    replacement = _build_resumable(real)
    assert replacement.__wrapped__ is real
    assert isinstance(_probe_script(MISSING), NotNeeded)

    def generate_and_save_hidden_states(args, dataset):  # a user's own function of that name
        return args, dataset

    assert isinstance(_probe_script(generate_and_save_hidden_states), NotNeeded)
    # the script's shape changed: it no longer saves through save_sample_to_disk -> drift, not skip
    g2 = dict(g)
    src = "def generate_and_save_hidden_states(args, dataset):\n    return find_last_checkpoint(args.output_dir)\n"
    exec(compile(src, "changed_script.py", "exec"), g2)
    problem = _probe_script(g2["generate_and_save_hidden_states"])
    assert problem and not isinstance(problem, NotNeeded) and "save_sample_to_disk" in problem, problem
    g3 = dict(g, save_config=lambda args: None)  # save_config's call no longer binds
    exec(compile("def generate_and_save_hidden_states(args, dataset):\n" + "\n".join(
        f"    {line}" for line in ["x = find_last_checkpoint, save_sample_to_disk, save_config",
                                   "generator.generate(args.output_dir, args.target_model_path, args.layer_ids,"
                                   " args.seq_length, args.gpu_memory_utilization, args.tensor_parallel_size,"
                                   " args.batch_size, args.start_idx)"]) + "\n", "s.py", "exec"), g3)
    problem = _probe_script(g3["generate_and_save_hidden_states"])
    assert problem and "save_config(args, generator, num_samples, output_dir)" in problem, problem


def test_the_sample_lengths_rule_follows_the_release():
    from speculators_compat.patches.speculators_script import _build_resumable

    for tag, writes in (("v0.3.0", False), ("v0.4.0.1", True)):
        real = _released_script_globals(tag)["generate_and_save_hidden_states"]
        assert ("sample_lengths.json" in real.__code__.co_consts) is writes, tag
        assert callable(_build_resumable(real))


def test_reading_the_scripts_leaves_vllm_envs_alone():
    from vllm import envs

    _released_script_globals("v0.4.0.1")
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in vars(envs)
