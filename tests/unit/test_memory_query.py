"""memory-query-torch-cuda: the platform's memory figure is bound in the generator module's
namespace only; torch.cuda.mem_get_info stays torch's own for every other caller and thread.

The mechanism runs on a fake generator module and a fake ``torch`` (no vLLM or torch needed);
the real probe against speculators 0.3.0 runs in the contract layer.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import threading
import types

import pytest
from _helpers import make_registry

from speculators_compat.patches import platform

pytestmark = pytest.mark.unit

GENERATOR_SOURCE = """
import torch

SEEN = {}


class VllmHiddenStatesGenerator:
    def __init__(self, inside, proceed):
        free_memory, _ = torch.cuda.mem_get_info()
        SEEN["free"] = free_memory
        SEEN["is_tensor"] = isinstance(torch.zeros(), torch.Tensor)
        inside.set()
        assert proceed.wait(10)
"""


def _fake_torch():
    torch = types.ModuleType("torch")
    cuda = types.ModuleType("torch.cuda")

    def mem_get_info():
        raise RuntimeError("Found no NVIDIA driver on your system")

    cuda.mem_get_info = mem_get_info
    torch.cuda = cuda

    class Tensor:
        pass

    torch.Tensor = Tensor
    torch.zeros = Tensor
    return torch


def _patch_for(module_name):
    real = next(p for p in platform.PATCHES if p.id == "memory-query-torch-cuda")
    assert (real.attribute, real.build) == ("torch", platform._bind_torch_view)
    # the real build on a fake generator module; the real probe needs vLLM (contract tests)
    return dataclasses.replace(real, hook_module=module_name, probe=lambda current: None)


def test_process_wide_mem_get_info_is_untouched_while_another_thread_constructs(fake_modules, clean_env, monkeypatch):
    torch = _fake_torch()
    original = torch.cuda.mem_get_info
    monkeypatch.setitem(sys.modules, "torch", torch)
    clean_env.setenv("SPECULATORS_COMPAT_KV_CACHE_BYTES", "123456789")
    name = fake_modules.write(GENERATOR_SOURCE)
    reg = make_registry([_patch_for(name)])
    reg.activate()
    gen = importlib.import_module(name)
    status = next(s for s in reg.statuses() if s.id == "memory-query-torch-cuda")
    assert (status.status, status.target) == ("applied", f"{name}:torch")

    inside, proceed = threading.Event(), threading.Event()
    errors = []

    def construct():
        try:
            gen.VllmHiddenStatesGenerator(inside, proceed)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            inside.set()

    worker = threading.Thread(target=construct)
    worker.start()
    try:
        assert inside.wait(10)
        # the constructor is running in the other thread, past its memory query: this thread
        # (and every module but the generator's) still sees torch's own function
        assert sys.modules["torch"].cuda.mem_get_info is original
        assert torch.cuda.mem_get_info is original
        with pytest.raises(RuntimeError, match="no NVIDIA driver"):
            torch.cuda.mem_get_info()
    finally:
        proceed.set()
        worker.join(10)
    assert errors == []
    assert gen.SEEN == {"free": 123456789, "is_tensor": True}
    assert torch.cuda.mem_get_info is original

    reg.deactivate()  # undo: the module global is torch itself again
    assert gen.torch is torch
    assert next(s for s in reg.statuses() if s.id == "memory-query-torch-cuda").status == "reverted"
