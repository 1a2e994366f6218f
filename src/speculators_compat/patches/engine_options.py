"""Engine options the hand-built ``VllmConfig`` has no way to receive.

speculators builds ``VllmConfig(...)`` itself, so a user cannot pass compilation or attention
settings. Two things need them (versions: compat_matrix.yaml):

- vLLM's CPU ``rotary_embedding`` custom op gives wrong results for non-neox (GPT-J style)
  rotary embeddings, which DeepSeek-V2/V3 and Kimi use (seen on 0.16 and 0.32: captured states
  off by ~4 max-abs beyond position 0, silently). On the CPU platform the patch disables that
  custom op (``compilation_config.custom_ops += ["-rotary_embedding"]``), so vLLM uses its
  native PyTorch implementation, which matches HF to ~1e-5. Other platforms are untouched.
- On accelerators, workers are started with ``spawn`` (``VLLM_WORKER_MULTIPROC_METHOD``, unless
  the user set it): a forked worker dies if the caller touched CUDA before (see the code).
- ``SPECULATORS_COMPAT_ATTENTION_BACKEND`` (e.g. ``TRITON_ATTN``) selects the attention backend
  through ``VllmConfig.attention_config`` where that field exists — needed where a build lacks
  the default backend (e.g. a GPU install without FlashAttention).
"""

from __future__ import annotations

import os

from ..registry import wrapper_patch
from ._signatures import GENERATOR, accepts, import_attr, require_params


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _vllm_config_options(wrapped, instance, args, kwargs):
    if not _on_cpu():
        # The generator starts its workers itself (MultiprocExecutor); vLLM forks them unless
        # it sees CUDA initialised at that moment — but a caller that only asked
        # torch.cuda.is_available() has touched the driver without that flag, and every worker
        # then dies with "Cannot re-initialize CUDA in forked subprocess" (measured on an
        # H200, vLLM 0.24). vLLM's own engine runs its workers from a fresh process; spawn here.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    if _on_cpu():
        from vllm.config import CompilationConfig

        compilation = kwargs.get("compilation_config")
        if compilation is None:
            compilation = CompilationConfig()
            kwargs["compilation_config"] = compilation
        if "-rotary_embedding" not in compilation.custom_ops:
            compilation.custom_ops = [*compilation.custom_ops, "-rotary_embedding"]
    backend = os.environ.get("SPECULATORS_COMPAT_ATTENTION_BACKEND")
    if backend and accepts(wrapped, "attention_config") and "attention_config" not in kwargs:
        from vllm.config import AttentionConfig

        kwargs["attention_config"] = AttentionConfig(backend=backend)
    return wrapped(*args, **kwargs)


def _probe(current):
    real = import_attr("vllm.config", "VllmConfig")
    problem = require_params(real, ("compilation_config", "model_config", "parallel_config"), "vllm.config.VllmConfig")
    if problem:
        return problem
    compilation = import_attr("vllm.config", "CompilationConfig")
    if not accepts(compilation, "custom_ops"):
        return "expected CompilationConfig(custom_ops=...); not found"
    return None


PATCHES = [
    wrapper_patch("engine-options", "platform", GENERATOR, "VllmConfig", _vllm_config_options, _probe),
]
