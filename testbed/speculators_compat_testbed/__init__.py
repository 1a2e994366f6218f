"""Test helpers: tiny deterministic models and an HF per-layer reference.

Importing this package does not import torch or transformers; they are imported inside the
functions that need them.
"""

from .reference import (
    ROW_TOLERANCE,
    TOLERANCE,
    CompareReport,
    compare,
    decoder_layers,
    hf_layer_outputs,
    load_hf_model,
    relative_error,
)
from .tiny_models import (
    ARCHITECTURES,
    MOE_ARCHITECTURES,
    MULTIMODAL_ARCHITECTURES,
    build_tiny_model,
    default_cache_root,
    tiny_config_kwargs,
    vllm_engine_kwargs,
    vllm_env,
    vllm_unsupported_reason,
)

__all__ = [
    "ROW_TOLERANCE",
    "ARCHITECTURES",
    "MOE_ARCHITECTURES",
    "MULTIMODAL_ARCHITECTURES",
    "TOLERANCE",
    "CompareReport",
    "build_tiny_model",
    "compare",
    "decoder_layers",
    "default_cache_root",
    "hf_layer_outputs",
    "load_hf_model",
    "relative_error",
    "tiny_config_kwargs",
    "vllm_engine_kwargs",
    "vllm_env",
    "vllm_unsupported_reason",
]
