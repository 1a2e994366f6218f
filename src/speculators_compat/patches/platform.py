"""The KV-cache memory budget: asked of the platform vLLM runs on, not of CUDA.

speculators asks CUDA for free memory; on a CPU vLLM that raises or answers for an unused
device. The patch answers from vLLM's platform: the device's ``mem_get_info`` on accelerators,
``VLLM_CPU_KVCACHE_SPACE`` on CPU. ``SPECULATORS_COMPAT_KV_CACHE_BYTES`` overrides the free
figure anywhere. Details: docs/MODULES.md.
"""

from __future__ import annotations

import inspect
import types

import wrapt

from ..registry import Call, Patch, wrapper_patch
from ._signatures import GENERATOR

_CPU_DEFAULT_GIB = 4.0  # vLLM's CPU default when VLLM_CPU_KVCACHE_SPACE is unset or 0


def platform_mem_get_info() -> tuple[int, int]:
    """(free, total) bytes for the KV cache, from the platform vLLM runs on."""
    from ..settings import number

    override = number("SPECULATORS_COMPAT_KV_CACHE_BYTES")
    if override is not None:
        value = int(override)
        return value, value
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        import vllm.envs as envs

        gib = float(getattr(envs, "VLLM_CPU_KVCACHE_SPACE", 0) or 0) or _CPU_DEFAULT_GIB
        space = int(gib * (1 << 30))
        return space, space
    import torch

    if current_platform.is_cuda_alike():
        return torch.cuda.mem_get_info()
    acc = torch.accelerator.current_accelerator()
    mod = torch.get_device_module(acc) if acc is not None else None
    if mod is not None and hasattr(mod, "mem_get_info"):
        return mod.mem_get_info()
    raise RuntimeError(
        f"speculators_compat: cannot read free memory on platform {type(current_platform).__name__} "
        "(set SPECULATORS_COMPAT_KV_CACHE_BYTES)"
    )


def _mem_get_info(wrapped, instance, args, kwargs):
    return platform_mem_get_info()


def _probe_platform(current):
    try:
        from vllm.platforms import current_platform
    except Exception as exc:  # noqa: BLE001
        return f"expected vllm.platforms.current_platform; import failed: {type(exc).__name__}: {exc}"
    for name in ("is_cpu", "is_cuda_alike"):
        if not callable(getattr(current_platform, name, None)):
            return f"expected current_platform.{name}(); found {type(current_platform).__name__} without it"
    return None


class _CudaView(wrapt.ObjectProxy):
    """``torch.cuda`` with ``mem_get_info`` answered by the platform vLLM runs on."""

    def mem_get_info(self, *args, **kwargs):
        return platform_mem_get_info()


class TorchView(wrapt.ObjectProxy):
    """``torch`` as the generator module sees it (memory-query-torch-cuda): ``torch.cuda`` is a
    view whose ``mem_get_info`` asks vLLM's platform; every other attribute is torch's own."""

    def __init__(self, torch_module):
        super().__init__(torch_module)
        self._self_cuda = _CudaView(torch_module.cuda)

    @property
    def cuda(self):
        return self._self_cuda


def _bind_torch_view(current):
    return TorchView(current)


def _probe_generator_torch(current):
    """0.3.0: the module global ``torch`` is the torch module, and the constructor asks it."""
    cuda = getattr(current, "cuda", None)
    if not isinstance(current, types.ModuleType) or not callable(getattr(cuda, "mem_get_info", None)):
        return f"expected the generator module's global torch to be the torch module; found {current!r}"
    import sys

    cls = getattr(sys.modules.get(GENERATOR), "VllmHiddenStatesGenerator", None)
    init = inspect.unwrap(getattr(cls, "__init__", None)) if cls is not None else None
    try:
        src = inspect.getsource(init)
    except (OSError, TypeError):
        return "expected VllmHiddenStatesGenerator.__init__ with readable source; found none"
    if "torch.cuda.mem_get_info()" not in src:
        return "expected VllmHiddenStatesGenerator.__init__ to call torch.cuda.mem_get_info(); it does not"
    return _probe_platform(current)


PLATFORM_CALLS = (Call("vllm.platforms", "current_platform.is_cpu"), Call("vllm.platforms", "current_platform.is_cuda_alike"))

PATCHES = [
    wrapper_patch("memory-query", "platform", GENERATOR, "mem_get_info", _mem_get_info, _probe_platform,
                  calls=PLATFORM_CALLS),
    Patch(
        id="memory-query-torch-cuda",
        family="platform",
        hook_module=GENERATOR,
        attribute="torch",
        build=_bind_torch_view,
        probe=_probe_generator_torch,
        calls=PLATFORM_CALLS,
    ),
]
