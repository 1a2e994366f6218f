"""Tiny checkpoints: what vLLM needs to run each arch, per platform (data, with one-line reasons).

Extra ``vllm.LLM(...)`` kwargs (:func:`vllm_engine_kwargs`), environment variables to set before
vLLM starts (:func:`vllm_env`), and the measured (arch, platform, dtype, vLLM release) cells that
cannot run (:func:`vllm_unsupported_reason`).
"""

from __future__ import annotations

from typing import Any

from .configs import ARCHITECTURES

# (arch, platform) -> {kwarg: (value, reason)}; platform "*" applies everywhere.
_VLLM_KWARGS: dict[tuple[str, str], dict[str, tuple[Any, str]]] = {
    ("deepseek_v3", "cpu"): {
        "compilation_config": (
            {"custom_ops": ["-rotary_embedding"]},
            "CPU rotary_embedding custom op is wrong for non-neox (interleaved) rope",
        ),
    },
    ("kimi_k25", "*"): {
        "trust_remote_code": (
            True,
            "the released checkpoint ships its config and image processor as remote code "
            "(vLLM 0.16 loads the processor with it regardless; speculators' generator passes it)",
        ),
    },
    ("kimi_k25", "cpu"): {  # its text decoder is DeepSeek-V3's
        "compilation_config": (
            {"custom_ops": ["-rotary_embedding"]},
            "CPU rotary_embedding custom op is wrong for non-neox (interleaved) rope",
        ),
    },
}

# (arch, platform) -> {ENV: (value, reason)}
_VLLM_ENV: dict[tuple[str, str], dict[str, tuple[str, str]]] = {
    ("*", "cpu"): {
        "VLLM_CPU_KVCACHE_SPACE": ("1", "1 GiB KV cache is plenty for tiny models"),
    },
    ("deepseek_v3", "cpu"): {
        "VLLM_MLA_DISABLE": ("1", "CPU has no MLA for these dims (0.32: only head size 576)"),
    },
    ("kimi_k25", "cpu"): {
        "VLLM_MLA_DISABLE": ("1", "CPU has no MLA for these dims (0.32: only head size 576)"),
    },
}


# Measured: vllm.LLM(model=<tiny dir>, dtype=..., enforce_eager=True, max_model_len=2048,
# **vllm_engine_kwargs(...)) with vllm_env(...) on CPU, 2 prompts x 16 greedy tokens, compared
# with HF greedy generation on the same weights.
#   vllm-cpu 0.16.0 (transformers 4.57.6), float32: llama qwen2 qwen3 qwen3_moe deepseek_v3
#     mistral gemma3 load, generate and match HF greedy for 16/16 tokens.  gpt_oss fails at the
#     first forward: "RuntimeError: expected scalar type BFloat16 but found Float" in
#     torch.ops._C.cpu_attention_with_kv_cache (the 0.16 CPU kernel takes attention sinks in
#     bf16 only); with dtype="bfloat16" gpt_oss runs (0.32's backend casts sinks to fp32).
#   vllm-cpu 0.32.0 (transformers 5.19.0), float32: all 8 load, generate, match HF greedy.
# (arch, platform) -> [(min_vllm_version_that_works, dtypes_affected, reason)]
_NO_RELEASE_YET = "1000000"  # no vLLM release runs it yet
_VLLM_DTYPE_LIMITS: dict[tuple[str, str], list[tuple[str, tuple[str, ...], str]]] = {
    ("gpt_oss", "cpu"): [
        (
            "0.32",  # measured: 0.16 fails, 0.32 works; versions between not measured
            ("float32", "float16"),
            "vLLM CPU attention kernel supports gpt-oss attention sinks only in bf16 "
            "(0.16: 'expected scalar type BFloat16 but found Float')",
        )
    ],
    # measured on vLLM 0.32 CPU (AVX2): "CPU GDN attention requires BF16" for float32
    ("qwen3_5", "cpu"): [(_NO_RELEASE_YET, ("float32", "float16"), "vLLM's CPU gated delta-net attention requires bf16")],
    ("qwen3_next", "cpu"): [(_NO_RELEASE_YET, ("float32", "float16"), "vLLM's CPU gated delta-net attention requires bf16")],
}


def vllm_unsupported_reason(
    arch: str, vllm_version: str, platform: str = "cpu", dtype: str = "float32"
) -> str | None:
    """Why ``arch`` cannot run in vLLM ``vllm_version`` on ``platform`` in ``dtype``, or None
    (None = no known problem; see the measured table above)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}")
    from speculators_compat.versions import normalize

    ver = normalize(vllm_version)
    for min_ok, dtypes, reason in _VLLM_DTYPE_LIMITS.get((arch, _platform(platform)), []):
        if dtype in dtypes and ver < normalize(min_ok):
            return reason
    return None


def _platform(platform: str) -> str:
    p = platform.lower()
    return "cuda" if p in ("gpu", "cuda", "nvidia") else p


def _merge(table: dict, arch: str, platform: str) -> dict:
    out: dict = {}
    for key in (("*", "*"), ("*", platform), (arch, "*"), (arch, platform)):
        for k, (v, _reason) in table.get(key, {}).items():
            out[k] = v
    return out


def vllm_engine_kwargs(arch: str, platform: str = "cpu") -> dict:
    """Extra ``vllm.LLM(...)`` kwargs that ``arch`` needs on ``platform`` ("cpu"/"cuda"); none of
    them depends on the vLLM release (measured on 0.16 and 0.32), so none is asked for."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}")
    import copy

    return copy.deepcopy(_merge(_VLLM_KWARGS, arch, _platform(platform)))


def vllm_env(arch: str, platform: str = "cpu") -> dict[str, str]:
    """Environment variables to set (before vLLM starts) for ``arch`` on ``platform``."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}")
    return _merge(_VLLM_ENV, arch, _platform(platform))
