"""Tiny, deterministic, random-weight checkpoints for tests and demos.

No model hub is needed: every model is built from a config written here, weights are
initialised from a fixed seed (per parameter name, so the values do not depend on the order
in which transformers creates modules), and a small BPE tokenizer is trained on an in-code
corpus.  Built models are cached on disk; see :func:`build_tiny_model`.

torch / transformers / tokenizers are imported lazily inside functions so that importing this
module stays cheap.

The code lives in :mod:`speculators_compat_testbed.tiny` (one module per responsibility); this
module re-exports its names, so ``tiny_models.X`` keeps working. Patch a name on the module that
reads it (e.g. ``tiny.build`` for what :func:`build_tiny_model` calls), not here.
"""

from __future__ import annotations

from .tiny.configs import (  # noqa: F401 (re-exported)
    ARCHITECTURES,
    FACTORY_VERSION,
    HEAD_DIM,
    HYBRID_ARCHITECTURES,
    MASSIVE,
    MASSIVE_ARCHITECTURES,
    MISTRAL_SLIDING_WINDOW,
    MOE_ARCHITECTURES,
    MULTIMODAL_ARCHITECTURES,
    SEED,
    VOCAB_SIZE,
    hf_unsupported_reason,
    tiny_config_kwargs,
    _ARCH_CLASS,
    _IMAGE_TOKEN,
    _KIMI_MEDIA_TOKENS,
    _KIMI_VISION,
    _LLAVA_IMAGE_SIZE,
    _LLAVA_PATCH,
    _MODEL_TYPE,
    _alternating,
    _kimi_k25_config,
    _make_config,
    _model_class,
)
from .tiny.tokenizer import (  # noqa: F401 (re-exported)
    _SPECIAL_TOKENS,
    _WORDS,
    _build_tokenizer,
    _corpus,
)
from .tiny.weights import (  # noqa: F401 (re-exported)
    _STD_BIAS,
    _STD_EMBED,
    _STD_LINEAR,
    _STD_NORM,
    _STD_ROUTER,
    _checkpoint_key,
    _init_tensor,
    _name_seed,
    _reinit_checkpoint,
)
from .tiny.kimi import (  # noqa: F401 (re-exported)
    _KIMI_CONFIG_CODE,
    _KIMI_MEDIA_PROC_CFG,
    _KIMI_PROCESSOR_CODE,
    _KIMI_WRAPPER_KEYS,
    _build_kimi_k25,
    _kimi_apply_overrides,
    _kimi_vision_shapes,
)
from .tiny.quantize import (  # noqa: F401 (re-exported)
    DEQUANTIZED_SUBDIR,
    KIMI_K25_W4A16_QUANTIZATION_CONFIG,
    QUANTIZATIONS,
    hf_reference_dir,
    quantization_ignored,
    quantize_w4a16,
    quantized_weight_names,
    _QUANTIZED_ARCHES,
    _ROUTED_EXPERT_WEIGHT,
    _quantize_kimi_w4a16,
    _w4a16_args,
)
from .tiny.build import (  # noqa: F401 (re-exported)
    build_tiny_model,
    default_cache_root,
    _COMPLETE_MARKER,
    _build_hf_checkpoint,
    _cache_key,
    _save_processor,
    _transformers_major,
)
from .tiny.support import (  # noqa: F401 (re-exported)
    vllm_engine_kwargs,
    vllm_env,
    vllm_unsupported_reason,
    _NO_RELEASE_YET,
    _VLLM_DTYPE_LIMITS,
    _VLLM_ENV,
    _VLLM_KWARGS,
    _merge,
    _platform,
)

__all__ = [
    "ARCHITECTURES",
    "FACTORY_VERSION",
    "MASSIVE_ARCHITECTURES",
    "MOE_ARCHITECTURES",
    "MULTIMODAL_ARCHITECTURES",
    "VOCAB_SIZE",
    "build_tiny_model",
    "default_cache_root",
    "tiny_config_kwargs",
    "vllm_engine_kwargs",
    "vllm_env",
    "vllm_unsupported_reason",
]
