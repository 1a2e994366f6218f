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
TOLERANCE: dict[str, float] = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}

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
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
    model.to(device)
    model.eval()
    return model


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


@dataclass
class CompareReport:
    dtype: str
    tolerance: float
    errors: list[list[float]] = field(default_factory=list)  # errors[seq][k]
    problems: list[str] = field(default_factory=list)  # shape mismatches, missing entries

    @property
    def max_error(self) -> float:
        vals = [e for row in self.errors for e in row]
        return max(vals) if vals else 0.0

    @property
    def passed(self) -> bool:
        if self.problems:
            return False
        return all(math.isfinite(e) and e <= self.tolerance for row in self.errors for e in row)

    def failures(self) -> list[tuple[int, int, float]]:
        return [
            (s, k, e)
            for s, row in enumerate(self.errors)
            for k, e in enumerate(row)
            if not (math.isfinite(e) and e <= self.tolerance)
        ]

    def as_dict(self) -> dict:
        return {
            "dtype": self.dtype, "tolerance": self.tolerance, "passed": self.passed,
            "max_error": self.max_error, "errors": self.errors, "problems": self.problems,
        }

    def summary(self) -> str:
        status = "PASS" if self.passed else "FAIL"
        lines = [f"{status}: max relative error {self.max_error:.3e} (tolerance "
                 f"{self.tolerance:.1e}, {self.dtype})"]
        lines += [f"  {p}" for p in self.problems]
        lines += [f"  seq {s} layer#{k}: {e:.3e}" for s, k, e in self.failures()]
        return "\n".join(lines)

    def __bool__(self) -> bool:
        return self.passed


def compare(captured, reference, dtype: Any = "float32", tolerance: float | None = None) -> CompareReport:
    """Compare ``captured[seq][k]`` with ``reference[seq][k]`` (both ``[len, hidden]``).

    ``captured[seq]`` may also be a single tensor ``[len, n_layers, hidden]`` or
    ``[n_layers, len, hidden]`` stacked per sequence; it is split along the layer axis.
    """
    import torch

    name = _dtype_name(dtype)
    tol = TOLERANCE[name] if tolerance is None else float(tolerance)
    rep = CompareReport(dtype=name, tolerance=tol)
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
                rep.errors.append([float("nan")] * len(ref_list))
                continue
        else:
            cap_list = list(cap)
        if len(cap_list) != len(ref_list):
            rep.problems.append(f"seq {s}: {len(cap_list)} captured layers vs {len(ref_list)}")
        row = []
        for k, (c, r) in enumerate(zip(cap_list, ref_list)):
            if tuple(c.shape) != tuple(r.shape):
                rep.problems.append(f"seq {s} layer#{k}: shape {tuple(c.shape)} vs {tuple(r.shape)}")
                row.append(float("nan"))
                continue
            row.append(relative_error(c, r))
        rep.errors.append(row)
    return rep
