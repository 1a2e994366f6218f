"""HF transformers reference for captured per-layer hidden states.

speculators' ``VllmHiddenStatesGenerator`` captures, after decoder layer i, the residual
stream (``hidden_states + residual``) *before* the final norm.  HF's
``output_hidden_states[-1]`` has the final norm applied, so the reference is taken from
forward hooks on the decoder layers instead (for non-last layers the two agree).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

__all__ = [
    "TOLERANCE",
    "CompareReport",
    "compare",
    "decoder_layers",
    "hf_layer_outputs",
    "load_hf_model",
    "relative_error",
]

# Relative Frobenius error allowed between a capture and the HF reference, by compute dtype.
# bf16 keeps 8 mantissa bits (2^-9 ~ 2e-3 relative rounding per operation); two correct bf16
# implementations with different kernels drift apart layer by layer. Measured on the tiny
# 4-layer models: 1.2-1.4e-2 on vLLM 0.14-0.32 (CPU) and 0.24 (H200), 2.0-2.3e-2 at the last
# layer on vLLM 0.11/0.12's CPU kernels - uniform over tokens, no outlier rows. A misplaced or
# missing row gives ~1 (measured 1.2-1.4 for Model Runner V2's reordering): 3e-2 separates the
# two by a factor of ~40. float32: 1e-4.
TOLERANCE: dict[str, float] = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3}

_DTYPE_NAMES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, str):
        name = dtype.lower().replace("torch.", "")
    else:
        name = str(dtype).replace("torch.", "")
    if name not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype!r}")
    return _DTYPE_NAMES[name]


def _torch_dtype(dtype: Any):
    import torch

    return getattr(torch, _dtype_name(dtype))


def load_hf_model(model_dir: str | Path, dtype: Any = "float32", device: str = "cpu"):
    """Load a causal LM once, directly in ``dtype`` (no dtype round trips), eager attention,
    eval mode."""
    import transformers
    from transformers import AutoModelForCausalLM

    td = _torch_dtype(dtype)
    kwargs: dict[str, Any] = {"attn_implementation": "eager"}
    major = int(transformers.__version__.split(".")[0])
    minor = int(transformers.__version__.split(".")[1])
    if (major, minor) >= (4, 56):
        kwargs["dtype"] = td
    else:
        kwargs["torch_dtype"] = td
    model = _wrapper_text_decoder(model_dir, td)
    if model is None:
        try:
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
        except ValueError:
            # multimodal wrappers (llava, Kimi-K2.5 on transformers 5, ...) are not causal-LM auto
            # classes; text-only input ids run their text decoder, whose layers decoder_layers() finds
            from transformers import AutoModelForImageTextToText

            model = AutoModelForImageTextToText.from_pretrained(str(model_dir), **kwargs)
    model.to(device)
    model.eval()
    return model


def _wrapper_text_decoder(model_dir: str | Path, torch_dtype):
    """For a multimodal wrapper this transformers has no class for (Kimi-K2.5, model_type
    kimi_k25, on transformers < 5), its text decoder alone: the text_config's causal LM on the
    checkpoint's ``language_model.*`` tensors (every one of them must load). None when the
    wrapper's own class exists (then the caller loads it) or the directory is no such wrapper."""
    import json

    cfg_path = Path(model_dir) / "config.json"
    if not cfg_path.exists():
        return None
    cfg = json.loads(cfg_path.read_text())
    text = cfg.get("text_config")
    from transformers import CONFIG_MAPPING

    if not isinstance(text, dict) or cfg.get("model_type") in CONFIG_MAPPING:
        return None
    text_type = text.get("model_type")
    if text_type not in CONFIG_MAPPING:
        raise ValueError(
            f"{cfg_path}: wrapper model_type {cfg.get('model_type')!r} and its text_config model_type "
            f"{text_type!r} are both unknown to this transformers"
        )
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    text_cfg = AutoConfig.for_model(text_type, **{k: v for k, v in text.items() if k != "model_type"})
    for k, v in text.items():  # keys some versions do not take as constructor arguments
        if k not in ("model_type", "rope_theta", "rope_scaling") and not hasattr(text_cfg, k):
            setattr(text_cfg, k, v)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        model = AutoModelForCausalLM.from_config(text_cfg, attn_implementation="eager")
    finally:
        torch.set_default_dtype(prev)
    state = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key.startswith("language_model."):
                    state[key[len("language_model."):]] = f.get_tensor(key)
    if not state:
        raise ValueError(f"{model_dir}: no language_model.* tensors for the text decoder of {cfg.get('model_type')!r}")
    model.load_state_dict(state, strict=True)  # every decoder tensor, no stray one
    return model.to(torch_dtype)


def decoder_layers(model) -> Sequence:
    """The decoder layer list of a (possibly multimodal) causal LM."""
    import torch

    candidates = []
    base = getattr(model, "model", None)
    if base is not None:
        candidates += [base, getattr(base, "language_model", None), getattr(base, "text_model", None)]
        lm = getattr(base, "language_model", None)
        if lm is not None:
            candidates.append(getattr(lm, "model", None))
    candidates.append(getattr(model, "language_model", None))
    if hasattr(model, "get_decoder"):
        try:
            candidates.append(model.get_decoder())
        except Exception:
            pass
    for c in candidates:
        layers = getattr(c, "layers", None) if c is not None else None
        if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
            return layers
    raise ValueError(f"cannot find decoder layers in {type(model).__name__}")


def hf_layer_outputs(
    model_dir: str | Path | Any,
    sequences: list[list[int]],
    layer_ids: list[int],
    dtype: Any = "float32",
    device: str = "cpu",
) -> list[list["torch.Tensor"]]:  # noqa: F821
    """Residual stream after each decoder layer in ``layer_ids`` for each sequence.

    ``model_dir`` may also be an already loaded model (from :func:`load_hf_model`).
    Sequences are run one at a time (batch 1, no padding).  Returns ``result[s][k]``: a CPU
    tensor ``[len(sequences[s]), hidden]`` in the model dtype, for ``layer_ids[k]``; the last
    layer's output is *not* final-normed.
    """
    import torch

    if isinstance(model_dir, (str, Path)):
        model = load_hf_model(model_dir, dtype=dtype, device=device)
    else:
        model = model_dir
    layers = decoder_layers(model)
    n = len(layers)
    for i in layer_ids:
        if not -n <= i < n:
            raise IndexError(f"layer id {i} out of range for {n} layers")
    wanted = sorted({i % n for i in layer_ids})
    captured: dict[int, torch.Tensor] = {}

    def make_hook(idx: int):
        def hook(_module, _args, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            captured[idx] = out.detach()

        return hook

    handles = [layers[i].register_forward_hook(make_hook(i)) for i in wanted]
    dev = next(model.parameters()).device
    results: list[list[torch.Tensor]] = []
    try:
        with torch.no_grad():
            for seq in sequences:
                captured.clear()
                ids = torch.tensor([list(seq)], dtype=torch.long, device=dev)
                model(input_ids=ids, use_cache=False)
                row = []
                for i in layer_ids:
                    t = captured[i % n]
                    if t.dim() == 3:
                        t = t[0]
                    row.append(t.to("cpu").clone())
                results.append(row)
    finally:
        for h in handles:
            h.remove()
    return results


def relative_error(a, b) -> float:
    """||a - b||_F / max(||b||_F, tiny), in float32."""
    import torch

    a = torch.as_tensor(a).detach().to("cpu", torch.float32)
    b = torch.as_tensor(b).detach().to("cpu", torch.float32)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch {tuple(a.shape)} vs {tuple(b.shape)}")
    num = torch.linalg.vector_norm(a - b).item()
    den = max(torch.linalg.vector_norm(b).item(), torch.finfo(torch.float32).tiny)
    return num / den


def _row_errors(a, b):
    """Per-token (row) relative errors of two [len, hidden] tensors, float32."""
    import torch

    a = torch.as_tensor(a).detach().to("cpu", torch.float32).reshape(-1, a.shape[-1])
    b = torch.as_tensor(b).detach().to("cpu", torch.float32).reshape(-1, b.shape[-1])
    den = torch.linalg.vector_norm(b, dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.linalg.vector_norm(a - b, dim=-1) / den


@dataclass
class CompareReport:
    """Errors of a capture against the reference.

    ``errors[s][k]``: relative Frobenius error of sequence s, layer_ids[k].
    ``outlier_fraction[s][k]``: share of tokens whose own relative error exceeds
    ``outlier_factor`` x the tolerance; ``inlier_errors[s][k]``: the Frobenius error over the other tokens.
    With ``max_outlier_fraction == 0`` (default) a comparison passes only if every
    ``errors`` entry is within tolerance.  MoE models in bf16/fp16 flip near-tied expert
    choices for a few tokens (measured HF bf16 vs HF fp32 on the tiny MoE models: 2-17%
    Frobenius error, from a few tokens); ``max_outlier_fraction > 0`` then passes when at
    most that share of tokens is off and the remaining tokens are within tolerance.
    """

    dtype: str
    tolerance: float
    max_outlier_fraction: float = 0.0
    errors: list[list[float]] = field(default_factory=list)  # errors[seq][k]
    outlier_fraction: list[list[float]] = field(default_factory=list)
    inlier_errors: list[list[float]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # shape mismatches, missing entries

    def _ok(self, s: int, k: int) -> bool:
        e = self.errors[s][k]
        if math.isfinite(e) and e <= self.tolerance:
            return True
        if self.max_outlier_fraction <= 0:
            return False
        frac = self.outlier_fraction[s][k]
        inl = self.inlier_errors[s][k]
        return (
            math.isfinite(frac) and frac <= self.max_outlier_fraction
            and math.isfinite(inl) and inl <= self.tolerance
        )

    @property
    def max_error(self) -> float:
        vals = [e for row in self.errors for e in row]
        return max(vals) if vals else 0.0

    @property
    def passed(self) -> bool:
        if self.problems:
            return False
        return all(self._ok(s, k) for s, row in enumerate(self.errors) for k in range(len(row)))

    def failures(self) -> list[tuple[int, int, float]]:
        return [
            (s, k, e)
            for s, row in enumerate(self.errors)
            for k, e in enumerate(row)
            if not self._ok(s, k)
        ]

    def as_dict(self) -> dict:
        return {
            "dtype": self.dtype, "tolerance": self.tolerance,
            "max_outlier_fraction": self.max_outlier_fraction, "passed": self.passed,
            "max_error": self.max_error, "errors": self.errors,
            "outlier_fraction": self.outlier_fraction, "inlier_errors": self.inlier_errors,
            "problems": self.problems,
        }

    def summary(self) -> str:
        status = "PASS" if self.passed else "FAIL"
        lines = [f"{status}: max relative error {self.max_error:.3e} (tolerance "
                 f"{self.tolerance:.1e}, {self.dtype})"]
        lines += [f"  {p}" for p in self.problems]
        lines += [
            f"  seq {s} layer#{k}: {e:.3e} (outlier tokens {self.outlier_fraction[s][k]:.1%}, "
            f"others {self.inlier_errors[s][k]:.3e})"
            for s, k, e in self.failures()
        ]
        return "\n".join(lines)

    def __bool__(self) -> bool:
        return self.passed


def compare(
    captured,
    reference,
    dtype: Any = "float32",
    tolerance: float | None = None,
    max_outlier_fraction: float = 0.0,
    outlier_factor: float = 4.0,
) -> CompareReport:
    """Compare ``captured[seq][k]`` with ``reference[seq][k]`` (both ``[len, hidden]``).

    ``captured[seq]`` may also be a single tensor ``[len, n_layers, hidden]`` or
    ``[n_layers, len, hidden]`` stacked per sequence; it is split along the layer axis.
    """
    import torch

    name = _dtype_name(dtype)
    tol = TOLERANCE[name] if tolerance is None else float(tolerance)
    rep = CompareReport(dtype=name, tolerance=tol, max_outlier_fraction=float(max_outlier_fraction))
    if len(captured) != len(reference):
        rep.problems.append(f"{len(captured)} captured sequences vs {len(reference)} reference")
    for s, (cap, ref) in enumerate(zip(captured, reference)):
        ref_list = list(ref)
        if isinstance(cap, torch.Tensor):
            if cap.dim() == 2 and len(ref_list) == 1:
                cap_list = [cap]
            elif cap.dim() == 3 and cap.shape[1] == len(ref_list) and cap.shape[0] == ref_list[0].shape[0]:
                cap_list = list(cap.unbind(1))
            elif cap.dim() == 3 and cap.shape[0] == len(ref_list):
                cap_list = list(cap.unbind(0))
            else:
                rep.problems.append(f"seq {s}: cannot split captured shape {tuple(cap.shape)}")
                nan_row = [float("nan")] * len(ref_list)
                rep.errors.append(nan_row)
                rep.outlier_fraction.append(list(nan_row))
                rep.inlier_errors.append(list(nan_row))
                continue
        else:
            cap_list = list(cap)
        if len(cap_list) != len(ref_list):
            rep.problems.append(f"seq {s}: {len(cap_list)} captured layers vs {len(ref_list)}")
        row, frac_row, inl_row = [], [], []
        for k, (c, r) in enumerate(zip(cap_list, ref_list)):
            if tuple(c.shape) != tuple(r.shape):
                rep.problems.append(f"seq {s} layer#{k}: shape {tuple(c.shape)} vs {tuple(r.shape)}")
                row.append(float("nan"))
                frac_row.append(float("nan"))
                inl_row.append(float("nan"))
                continue
            row.append(relative_error(c, r))
            rows = _row_errors(c, r)
            bad = ~(rows <= tol * outlier_factor)  # NaN counts as bad
            frac_row.append(bad.float().mean().item() if rows.numel() else 0.0)
            keep = ~bad
            if keep.any():
                c2 = torch.as_tensor(c).reshape(-1, c.shape[-1])[keep]
                r2 = torch.as_tensor(r).reshape(-1, r.shape[-1])[keep]
                inl_row.append(relative_error(c2, r2))
            else:
                inl_row.append(float("nan"))
        rep.errors.append(row)
        rep.outlier_fraction.append(frac_row)
        rep.inlier_errors.append(inl_row)
    return rep
