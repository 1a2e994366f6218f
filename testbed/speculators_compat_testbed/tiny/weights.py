"""Tiny checkpoints: deterministic weights.

Every tensor is drawn from a seed derived from its saved name (so values do not depend on the
order in which transformers creates modules nor on its init functions), with per-kind scales
(linear, embedding, router, norm, bias) and, for the "massive" archs, a trained model's
very-high-norm rows and channels in the embedding.

torch / safetensors are imported lazily inside functions.
"""

from __future__ import annotations

import zlib
from pathlib import Path

from .configs import HYBRID_ARCHITECTURES, MASSIVE, MASSIVE_ARCHITECTURES, SEED

# Initialisation scales (the residual stream must be far from 0 and layers must move it).
_STD_LINEAR = 0.05
_STD_EMBED = 0.1
_STD_ROUTER = 0.2  # larger: fewer near-ties in expert selection between implementations
_STD_NORM = 0.1  # norm weights are 1 + N(0, 0.1) (Gemma: N(0, 0.1), it applies 1 + w)
_STD_BIAS = 0.02


def _name_seed(name: str) -> int:
    return (SEED * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFFFFFF


def _init_tensor(name: str, t, arch: str) -> None:
    import torch

    g = torch.Generator().manual_seed(_name_seed(name))
    shape = t.shape
    leaf = name.rsplit(".", 1)[-1]
    lname = name.lower()

    def randn(std: float):
        return torch.randn(shape, generator=g, dtype=torch.float32) * std

    if "norm" in lname and t.dim() == 1:
        # Gemma, Qwen3.5 and Qwen3-Next RMSNorms multiply by (1 + w); the gated delta-net's own
        # output norm (linear_attn.norm) multiplies by w
        offset_norm = arch == "gemma3" or (arch in HYBRID_ARCHITECTURES and "linear_attn.norm" not in lname)
        base = 0.0 if offset_norm else 1.0
        val = base + randn(_STD_NORM)
    elif leaf == "e_score_correction_bias":
        val = randn(0.1)  # non-zero so the noaux_tc bias affects expert selection
    elif leaf == "sinks":
        val = randn(1.0)
    elif "embed_tokens" in lname:
        val = randn(_STD_EMBED)
        if arch in MASSIVE_ARCHITECTURES and t.dim() == 2:
            val[:, list(MASSIVE["channels"])] *= MASSIVE["channel_scale"]
            for row in MASSIVE["rows"]:
                val[row, list(MASSIVE["row_channels"])] = MASSIVE["row_value"]
    elif ("router" in lname or lname.endswith("mlp.gate.weight")) and leaf in ("weight",):
        val = randn(_STD_ROUTER)
    elif leaf.endswith("bias") or t.dim() == 1:
        val = randn(_STD_BIAS)
    else:
        val = randn(_STD_LINEAR)
    with torch.no_grad():
        t.copy_(val.to(t.dtype))


def _reinit_checkpoint(directory: Path, arch: str) -> None:
    """Overwrite every tensor of the saved checkpoint with seeded values keyed by its saved
    name.  transformers 4.x and 5.x save the same key names and shapes for these models
    (5.x converts fused MoE experts back on save), so the weights do not depend on the
    transformers version nor on its module creation order / init functions."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    for path in sorted(directory.glob("*.safetensors")):
        tensors = {}
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            for key in sorted(f.keys()):
                t = f.get_tensor(key)
                key = _checkpoint_key(arch, key)
                new = torch.empty(t.shape, dtype=torch.float32)
                _init_tensor(key, new, arch)
                tensors[key] = new.to(t.dtype).contiguous()
        metadata = {"format": metadata.get("format", "pt")}
        save_file(tensors, str(path), metadata=metadata)


def _checkpoint_key(arch: str, key: str) -> str:
    """The name a tensor is saved under: the released checkpoints' layout.

    transformers 5 saves llava's CLIP tower as ``vision_tower.embeddings...``; released llava
    checkpoints (and vLLM's loader, and transformers 4 and 5 when loading) use
    ``vision_tower.vision_model.embeddings...``."""
    if arch == "llava" and key.startswith("vision_tower.") and not key.startswith("vision_tower.vision_model."):
        return "vision_tower.vision_model." + key[len("vision_tower."):]
    return key
