"""The CPU attention kernel the generator's engine will run, read from the installed vLLM.

vLLM's CPU attention (0.12+) picks a kernel ISA per (dtype, block size, head size): ``amx`` for
bf16 at block sizes divisible by 32 on AMX CPUs, a kernel some wheels lack (0.16: "Unsupported
CPU attention configuration: head_dim=64 isa=0"). ``attention_plan`` calls the installed rule
and tries its ISA with the kernel's first op; engine-options keeps speculators' block size 16
only where the platform's pick cannot run, and refuses in one line where neither can.
"""

from __future__ import annotations

from dataclasses import dataclass

PLATFORM_PICK = 128  # CpuPlatform.check_and_update_config: block_size None -> 128 (0.12-0.32)
METADATA_ARGS = ("num_reqs", "num_heads", "num_kv_heads", "head_dim", "seq_lens", "dtype", "query_start_loc",
                 "causal", "sliding_window_size", "isa", "enable_kv_split")
CPU_FLAGS = ("amx_bf16", "amx_tile", "amx_int8", "avx512_bf16", "avx512f", "avx2")


@dataclass(frozen=True)
class AttentionPlan:
    """What the CPU attention kernel does for one (dtype, head size): ``block_size`` None keeps
    vLLM's choice; ``problem`` is set where no candidate runs (then the engine must not start)."""

    dtype: str
    head_size: int
    tried: tuple  # ((block size, isa, error or None), ...) in the order tried
    block_size: int | None = None
    problem: str | None = None

    def __str__(self) -> str:
        steps = "; ".join(f"block {b} -> isa {i!r}: {e or 'runs'}" for b, i, e in self.tried)
        return f"CPU attention, {self.dtype}, head size {self.head_size}: {steps}"


def cpu_flags() -> str:
    """The attention-relevant flags of this CPU (from /proc/cpuinfo), or '' where unreadable."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return " ".join(f for f in CPU_FLAGS if f in have)
    except OSError:
        pass
    return ""


def isa_rule():
    """The installed ``_get_attn_isa``, or None where this vLLM has no such rule (0.11: SDPA)."""
    try:
        from vllm.v1.attention.backends import cpu_attn
    except ImportError:
        return None
    return getattr(cpu_attn, "_get_attn_isa", None)


def pick_isa(dtype, block_size: int, head_size: int, kv_cache_dtype=None) -> str:
    """The ISA the installed rule picks (0.12-0.13 take no head size, 0.32 a KV-cache dtype)."""
    from ._signatures import accepts

    rule = isa_rule()
    kwargs = {"head_size": head_size} if accepts(rule, "head_size") else {}
    if kv_cache_dtype and accepts(rule, "kv_cache_dtype"):
        kwargs["kv_cache_dtype"] = kv_cache_dtype
    return rule(dtype, block_size, **kwargs)


def kernel_error(isa: str, dtype, head_size: int) -> str | None:
    """None where the installed kernel accepts ``isa`` for (dtype, head size), else its message."""
    import torch

    from vllm import _custom_ops as ops

    try:
        ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1, num_heads=1, num_kv_heads=1, head_dim=head_size,
            seq_lens=torch.tensor([1], dtype=torch.int32), dtype=dtype,
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32), causal=True,
            sliding_window_size=-1, isa=isa, enable_kv_split=True,
        )
    except Exception as exc:  # noqa: BLE001 - the kernel's refusal is the answer
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)}"
    return None


def _accepts(block_size: int) -> bool:
    """Whether vLLM's CPU attention backend declares ``block_size`` supported."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = getattr(CPUAttentionBackend, "get_supported_kernel_block_sizes", None)
    if sizes is None:
        return True
    return any(block_size % int(getattr(s, "base", s)) == 0 for s in sizes())  # as supports_block_size


def attention_plan(dtype, head_size: int, requested: int | None, own: int = 16, kv_cache_dtype=None) -> AttentionPlan:
    """The block size to give the engine: ``requested`` (None: the platform picks PLATFORM_PICK)
    where its kernel runs, else speculators' ``own`` where vLLM accepts it and its kernel runs."""
    from ._signatures import import_attr, require_params

    rule = isa_rule()
    name = str(dtype).replace("torch.", "")
    if rule is None:
        return AttentionPlan(name, head_size, ())
    problem = require_params(rule, ("dtype", "block_size"), "cpu_attn._get_attn_isa") or require_params(
        import_attr("vllm._custom_ops", "cpu_attn_get_scheduler_metadata"), METADATA_ARGS,
        "vllm._custom_ops.cpu_attn_get_scheduler_metadata")
    if problem:
        raise RuntimeError(problem)
    first = PLATFORM_PICK if requested is None else requested
    tried: list[tuple[int, str | None, str | None]] = []
    for block in dict.fromkeys((first, own)):
        if block != first and not _accepts(block):
            tried.append((block, None, "not a block size this vLLM's CPU attention accepts"))
            continue
        isa = pick_isa(dtype, block, head_size, kv_cache_dtype)
        err = kernel_error(isa, dtype, head_size)
        tried.append((block, isa, err))
        if err is None:
            chosen = None if block == first else block
            return AttentionPlan(name, head_size, tuple(tried), block_size=chosen)
    plan = AttentionPlan(name, head_size, tuple(tried))
    problem = f"{plan}: no block size runs on this CPU ({cpu_flags() or 'flags unknown'})"
    return AttentionPlan(name, head_size, plan.tried, problem=problem)
