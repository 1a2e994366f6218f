"""Tiny checkpoints: building them, and the on-disk cache.

:func:`build_tiny_model` builds (or reuses) ``<root>/<arch>-l<layers>-h<hidden>-<dtype>-tf<major>-<hash>``:
the config from :mod:`.configs`, the checkpoint from transformers (``_build_hf_checkpoint``, its
weights re-drawn by :mod:`.weights`, its tokenizer or llava processor) or :mod:`.kimi`, optionally
quantized by :mod:`.quantize`, then moved into place atomically with a completion marker.
:func:`default_cache_root` is ``$SPECULATORS_COMPAT_MODEL_CACHE`` or ``~/.cache/speculators_compat/models``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from .configs import (
    _IMAGE_TOKEN,
    _LLAVA_IMAGE_SIZE,
    _LLAVA_PATCH,
    _QWEN35_TOKENS,
    ARCHITECTURES,
    FACTORY_VERSION,
    MASSIVE,
    MASSIVE_ARCHITECTURES,
    MULTIMODAL_ARCHITECTURES,
    SEED,
    VOCAB_SIZE,
    _make_config,
    _model_class,
    tiny_config_kwargs,
)
from .kimi import _build_kimi_k25, _kimi_apply_overrides
from .quantize import _QUANTIZED_ARCHES, KIMI_K25_W4A16_QUANTIZATION_CONFIG, QUANTIZATIONS, _quantize_kimi_w4a16
from .tokenizer import _build_tokenizer
from .weights import _reinit_checkpoint

_COMPLETE_MARKER = ".speculators_compat_complete"


def default_cache_root() -> Path:
    env = os.environ.get("SPECULATORS_COMPAT_MODEL_CACHE")
    if env:
        return Path(env).expanduser()
    return Path("~/.cache/speculators_compat/models").expanduser()


def _save_processor(arch: str, directory: Path) -> None:
    """Tokenizer (with the image token), image processor and processor of a multimodal arch."""
    if arch == "qwen3_5":  # the vision special tokens last; the image processor from vision_config
        from ..rehearsal import stand_in_image_processor

        _build_tokenizer(VOCAB_SIZE, extra_special=_QWEN35_TOKENS).save_pretrained(directory)
        cfg = json.loads((directory / "config.json").read_text())
        (directory / "preprocessor_config.json").write_text(json.dumps(stand_in_image_processor(cfg), indent=2) + "\n")
        return
    from transformers import CLIPImageProcessor, LlavaProcessor

    tok = _build_tokenizer(VOCAB_SIZE, extra_special=(_IMAGE_TOKEN,))
    assert tok.convert_tokens_to_ids(_IMAGE_TOKEN) == VOCAB_SIZE - 1
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": _LLAVA_IMAGE_SIZE},
        crop_size={"height": _LLAVA_IMAGE_SIZE, "width": _LLAVA_IMAGE_SIZE},
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=_LLAVA_PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS
        image_token=_IMAGE_TOKEN,
        chat_template=tok.chat_template,
    )
    processor.save_pretrained(directory)
    tok.save_pretrained(directory)


def _transformers_major() -> int:
    import transformers

    from speculators_compat.versions import normalize

    return normalize(transformers.__version__).major


def _cache_key(
    arch: str, num_layers: int, hidden_size: int, dtype: str, overrides: dict, quantization: str | None = None
) -> str:
    extra = {} if quantization is None else {"quantization": quantization, "qconfig": KIMI_K25_W4A16_QUANTIZATION_CONFIG}
    payload = json.dumps(
        {
            **extra,
            "factory": FACTORY_VERSION,
            "arch": arch,
            "num_layers": num_layers,
            "hidden_size": hidden_size,
            "dtype": dtype,
            "config": tiny_config_kwargs(arch, num_layers=num_layers, hidden_size=hidden_size),
            "overrides": overrides,
            **({"massive": MASSIVE} if arch in MASSIVE_ARCHITECTURES else {}),
        },
        sort_keys=True,
        default=repr,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:10]


def _build_hf_checkpoint(tmp: Path, arch: str, cfg, dtype: str) -> None:
    """The checkpoint of an arch transformers builds from its config (every arch but kimi_k25)."""
    import torch

    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            model = _model_class(arch).from_config(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.eval()
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
    model.save_pretrained(tmp, safe_serialization=True)
    _reinit_checkpoint(tmp, arch)
    if arch in MULTIMODAL_ARCHITECTURES:
        _save_processor(arch, tmp)
    else:
        tok = _build_tokenizer(cfg.vocab_size)
        tok.save_pretrained(tmp)


def build_tiny_model(
    arch: str,
    root: str | Path | None = None,
    *,
    num_layers: int = 4,
    hidden_size: int = 128,
    dtype: str = "float32",
    overrides: dict | None = None,
    quantization: str | None = None,
) -> Path:
    """Build (or reuse from the cache) a tiny random checkpoint of ``arch``; return its dir.

    ``quantization="w4a16"`` (kimi_k25 only): Kimi-K2.5 INT4 as released: the routed experts'
    weights in compressed-tensors pack-quantized W4A16 (int4 symmetric, group 32), the released
    ``quantization_config`` in ``text_config``, every ignored module in ``dtype``; the same
    model dequantized lies in ``<dir>/dequantized/`` (:func:`hf_reference_dir`) for HF.

    The directory ``<root>/<arch>-l<layers>-h<hidden>-<dtype>-tf<major>-<hash>`` holds
    ``config.json``, ``model.safetensors``, tokenizer files and a completion marker.
    ``root`` defaults to ``$SPECULATORS_COMPAT_MODEL_CACHE`` or
    ``~/.cache/speculators_compat/models``.  The transformers major version is part of the
    name because transformers 5 saves some configs (rope_parameters) differently.
    Same inputs (and the same transformers/torch) give byte-identical safetensors.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHITECTURES}")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"unsupported dtype {dtype!r}")
    if quantization is not None and (quantization not in QUANTIZATIONS or arch not in _QUANTIZED_ARCHES[quantization]):
        raise ValueError(f"quantization {quantization!r} is not built for {arch!r} ({_QUANTIZED_ARCHES})")
    overrides = dict(overrides or {})
    root = Path(root).expanduser() if root is not None else default_cache_root()
    tf_major = _transformers_major()
    key = _cache_key(arch, num_layers, hidden_size, dtype, overrides, quantization)
    qtag = f"-{quantization}" if quantization else ""
    name = f"{arch}{qtag}-l{num_layers}-h{hidden_size}-{dtype}-tf{tf_major}-{key}"
    final = root / name
    if (final / _COMPLETE_MARKER).exists():
        return final


    root.mkdir(parents=True, exist_ok=True)
    kwargs = tiny_config_kwargs(arch, num_layers=num_layers, hidden_size=hidden_size)
    if arch == "kimi_k25":  # a wrapper config written as JSON (transformers 4 has no class for it)
        kwargs = _kimi_apply_overrides(kwargs, overrides)
    else:
        kwargs.update(overrides)
        cfg = _make_config(arch, kwargs)

    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    try:
        if arch == "kimi_k25":
            _build_kimi_k25(tmp, kwargs, dtype)
        else:
            _build_hf_checkpoint(tmp, arch, cfg, dtype)
        qinfo = _quantize_kimi_w4a16(tmp, dtype) if quantization == "w4a16" else None
        (tmp / "speculators_compat_tiny.json").write_text(
            json.dumps(
                {"arch": arch, "factory_version": FACTORY_VERSION, "key": key,
                 "num_layers": num_layers, "hidden_size": hidden_size, "dtype": dtype,
                 "overrides": overrides, **({"quantization": quantization, **qinfo} if qinfo else {})},
                sort_keys=True, indent=1, default=repr,
            )
        )
        (tmp / _COMPLETE_MARKER).write_text("ok\n")
        try:
            os.rename(tmp, final)
        except OSError:
            # Someone else finished first (or a stale incomplete dir is in the way).
            if (final / _COMPLETE_MARKER).exists():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
