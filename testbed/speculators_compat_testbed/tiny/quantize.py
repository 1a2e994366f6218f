"""Tiny checkpoints: INT4 as released (``quantization="w4a16"``).

Kimi-K2.5's routed experts in compressed-tensors pack-quantized W4A16 (int4, symmetric, group 32),
everything else in the checkpoint dtype: the released ``quantization_config`` block, the ignore-list
matching, which weights get packed, packing one weight (:func:`quantize_w4a16`), turning a built
checkpoint into the quantized one (with a dequantized copy for HF) and :func:`hf_reference_dir`.

torch / safetensors / compressed_tensors are imported lazily inside functions.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

QUANTIZATIONS: tuple[str, ...] = ("w4a16",)
_QUANTIZED_ARCHES = {"w4a16": ("kimi_k25",)}

# The quantization_config block as moonshotai/Kimi-K2.5 (and Kimi-K2-Thinking / K2.6) write it,
# inside text_config (vLLM >= 0.16 reads text_config.quantization_config of a multimodal
# wrapper). Sources: the ignore list vLLM's humming test quotes as "the real ignore list from
# Kimi-K2.6's compressed-tensors quantization_config", and public Kimi-K2.5 fixtures of the same
# block; Kimi-K2-Thinking (text only) has the first four ignore entries.
KIMI_K25_W4A16_QUANTIZATION_CONFIG: dict[str, Any] = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": 32,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "ignore": [
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
        "re:.*lm_head.*",
        "re:vision_tower.*",
        "re:mm_projector.*",
    ],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}

# The Linear weights the released checkpoint packs: the routed experts' (every other Linear is
# matched by an ignore entry; the router ``mlp.gate`` is no Linear in HF nor quantized in vLLM).
_ROUTED_EXPERT_WEIGHT = r"^language_model\.model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$"
DEQUANTIZED_SUBDIR = "dequantized"


def quantization_ignored(module: str, ignore: list[str] | None = None) -> bool:
    """Whether ``module`` (a dotted module name) matches the ignore list as compressed-tensors
    matches it: ``re:`` entries with ``re.match`` (anchored at the start), others exactly or as
    a name suffix."""
    import re

    for entry in KIMI_K25_W4A16_QUANTIZATION_CONFIG["ignore"] if ignore is None else ignore:
        if entry.startswith("re:"):
            if re.match(entry[3:], module):
                return True
        elif module == entry or module.endswith("." + entry):
            return True
    return False


def quantized_weight_names(names) -> list[str]:
    """Of a checkpoint's bf16/float tensor names, the ``*.weight`` tensors the w4a16 variant packs."""
    import re

    out = [n for n in names if re.match(_ROUTED_EXPERT_WEIGHT, n)]
    for n in out:  # the ignore list must not cover what gets packed (it is what vLLM reads)
        assert not quantization_ignored(n[: -len(".weight")]), n
    return sorted(out)


def _w4a16_args():
    from compressed_tensors.quantization import QuantizationArgs

    w = KIMI_K25_W4A16_QUANTIZATION_CONFIG["config_groups"]["group_0"]["weights"]
    return QuantizationArgs(**w)


def quantize_w4a16(weight, scale_dtype):
    """Pack one ``[out, in]`` weight as compressed-tensors' pack-quantized W4A16 (int4,
    symmetric, group 32, minmax observer); returns ``(tensors, dequantized)`` where ``tensors``
    holds ``weight_packed`` (int32 ``[out, in/8]``), ``weight_scale`` (``[out, in/32]`` in
    ``scale_dtype``) and ``weight_shape`` (int64 ``[2]``), and ``dequantized`` is what a
    W4A16 kernel multiplies by (float32: ``q * scale``)."""
    import torch
    from compressed_tensors.compressors import pack_to_int32, unpack_from_int32
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = _w4a16_args()
    gs = args.group_size
    w = weight.detach().to(torch.float32)
    out_f, in_f = w.shape
    if in_f % gs:
        raise ValueError(f"in_features {in_f} is no multiple of the group size {gs}")
    grouped = w.reshape(out_f, in_f // gs, gs)
    scale, zp = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    scale = scale.to(scale_dtype).to(torch.float32)  # stored in scale_dtype: quantize with that value
    q = quantize(x=w, scale=scale, zero_point=zp, args=args, dtype=torch.int8)
    packed = pack_to_int32(q, args.num_bits)
    unpacked = unpack_from_int32(packed, args.num_bits, torch.Size(w.shape))
    assert torch.equal(unpacked.to(torch.int8), q.to(torch.int8)), "pack/unpack round trip"
    deq = dequantize(x_q=unpacked, scale=scale, zero_point=None, args=args, dtype=torch.float32)
    tensors = {
        "weight_packed": packed.contiguous(),
        "weight_scale": scale.to(scale_dtype).contiguous(),
        "weight_shape": torch.tensor([out_f, in_f], dtype=torch.int64),
    }
    return tensors, deq


def _quantize_kimi_w4a16(directory: Path, dtype: str) -> dict:
    """Turn the bf16/float Kimi-K2.5 checkpoint in ``directory`` into the INT4 one as released;
    write the dequantized weights (the same model, unpacked) under ``dequantized/`` for HF.
    Returns a summary for the marker file."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    src = directory / "model.safetensors"
    with safe_open(str(src), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    targets = quantized_weight_names(tensors)
    if not targets:
        raise RuntimeError("no routed-expert weights to quantize")
    packed: dict = {}
    dequantized: dict = {}
    worst = 0.0
    for name, t in tensors.items():
        if name in targets:
            parts, deq = quantize_w4a16(t, t.dtype)
            base = name[: -len(".weight")]
            for suffix, v in parts.items():
                packed[f"{base}.{suffix}"] = v
            dequantized[name] = deq.to(t.dtype).contiguous()
            ref = t.to(torch.float32)
            worst = max(worst, float((deq - ref).norm() / ref.norm()))
        else:
            packed[name] = t
            dequantized[name] = t
    deq_dir = directory / DEQUANTIZED_SUBDIR
    deq_dir.mkdir()
    for p in directory.iterdir():  # config, tokenizer, remote code, processor: the same files
        if p.is_file() and p.name != "model.safetensors":
            shutil.copy2(p, deq_dir / p.name)
    save_file(dequantized, str(deq_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(packed, str(src), metadata={"format": "pt"})
    cfg = json.loads((directory / "config.json").read_text())
    cfg["text_config"]["quantization_config"] = json.loads(json.dumps(KIMI_K25_W4A16_QUANTIZATION_CONFIG))
    (directory / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return {"quantized_weights": len(targets), "max_relative_weight_error": worst}


def hf_reference_dir(model_dir: str | Path) -> Path:
    """Where HF loads ``model_dir``'s weights from: its dequantized copy for a quantized tiny model
    (HF on the dequantized weights is the reference), else the directory itself."""
    d = Path(model_dir) / DEQUANTIZED_SUBDIR
    return d if (d / "model.safetensors").exists() else Path(model_dir)
