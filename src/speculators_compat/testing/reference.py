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
    "ROW_TOLERANCE",
    "TOLERANCE",
    "CompareReport",
    "compare",
    "decoder_layers",
    "hf_layer_outputs",
    "load_hf_model",
    "relative_error",
    "row_errors",
]

# Relative Frobenius error allowed between a capture and the HF reference, by compute dtype.
# bf16 keeps 8 mantissa bits (2^-9 ~ 2e-3 relative rounding per operation); two correct bf16
# implementations with different kernels drift apart layer by layer. Measured on the tiny
# 4-layer models: 1.2-1.4e-2 on vLLM 0.14-0.32 (CPU) and 0.24 (H200), 2.0-2.3e-2 at the last
# layer on vLLM 0.11/0.12's CPU kernels - uniform over tokens. Sequences in the wrong order give
# ~1 (measured 1.2-1.4 for Model Runner V2's reordering); ONE wrong row in 2,000 does not move
# this figure past the tolerance - ROW_TOLERANCE below catches that. float32: 1e-4.
TOLERANCE: dict[str, float] = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3}

# Bound on EVERY row (token) of every (sequence, layer): ||c_i - r_i|| / ||r_i||. The Frobenius
# figure above averages over ~2,000 rows, so one wrong row moves it by ~1/sqrt(2000) only (a row
# copied from its neighbour: 3e-2, a zeroed row: 2.2e-2 - both under 3e-2); this bound does not.
# Measured with the e2e runner (speculators 0.4.0.1, vLLM 0.32.0 CPU, layers 1-3 of the tiny
# 4-layer models, all 23 sequences = 47,151 rows per arch, bf16 vs HF bf16):
#   correct rows       llama p50 9.2e-3  p99 1.4e-2  p99.9 1.7e-2  max 2.26e-2
#                      qwen3 p50 1.0e-2  p99 1.6e-2  p99.9 1.8e-2  max 2.43e-2
#   wrong rows         zeroed row: 1.0 exactly; the reference row of the next/previous token in
#                      its place (a duplicated or shifted row) where the two tokens differ:
#                      llama min 0.40 (p0.1 0.52, median 1.26), qwen3 min 0.47 (median 1.28)
# 0.1 sits 4x above the worst correct row and 4x below the closest wrong row. (Where two
# neighbouring tokens are the same id, ~1 in 1,000 random positions, their rows are close -
# 0.014 to 0.38 apart - and a swap of the two is not a wrong answer the check could see.)
# float32 (same runner, --dtype float32, llama): correct rows p50 6.1e-7, p99.9 1.1e-6, max 1.4e-6;
# wrong rows (neighbour, distinct tokens) min 0.40. 1e-3 sits ~700x above and ~400x below.
# float16 (no CPU engine computes in it; not measured) scales the bf16 bound by the dtypes'
# rounding (8 vs 11 mantissa bits): 2e-2, still 20x below the closest wrong row.
ROW_TOLERANCE: dict[str, float] = {"float32": 1e-3, "bfloat16": 0.1, "float16": 2e-2}

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
    """Per-token (row) relative errors ``||a_i - b_i|| / ||b_i||`` of two [len, hidden] tensors,
    float32 (NaN/inf in ``a`` give NaN/inf, never a pass)."""
    import torch

    a = torch.as_tensor(a).detach().to("cpu", torch.float32).reshape(-1, a.shape[-1])
    b = torch.as_tensor(b).detach().to("cpu", torch.float32).reshape(-1, b.shape[-1])
    den = torch.linalg.vector_norm(b, dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.linalg.vector_norm(a - b, dim=-1) / den


row_errors = _row_errors


@dataclass
class CompareReport:
    """Errors of a capture against the reference.

    Two bounds, both must hold for every (sequence, layer):

    - ``errors[s][k]``: relative Frobenius error of sequence s, layer_ids[k] <= ``tolerance``;
    - every row (token) of it: ``||c_i - r_i|| / ||r_i|| <= row_tolerance``.
      ``worst_rows[s][k]`` = ``[row, error]`` of its worst row, ``rows_over[s][k]`` = how many
      rows exceed the bound.

    There is no allowance by count: one zeroed, misplaced, duplicated or shifted row fails.
    """

    dtype: str
    tolerance: float
    row_tolerance: float
    errors: list[list[float]] = field(default_factory=list)  # errors[seq][k]
    worst_rows: list[list[list]] = field(default_factory=list)  # [row index, row error] per (seq, k)
    rows_over: list[list[int]] = field(default_factory=list)
    row_quantiles: dict = field(default_factory=dict)  # over all rows of all (seq, k)
    problems: list[str] = field(default_factory=list)  # shape mismatches, missing entries

    def _ok(self, s: int, k: int) -> bool:
        e = self.errors[s][k]
        _, w = self.worst_rows[s][k]
        return (
            math.isfinite(e) and e <= self.tolerance
            and w is not None and math.isfinite(w) and w <= self.row_tolerance
            and self.rows_over[s][k] == 0
        )

    @property
    def max_error(self) -> float:
        vals = [e for row in self.errors for e in row]
        if any(not math.isfinite(v) for v in vals):
            return float("nan")
        return max(vals) if vals else 0.0

    @property
    def worst_row(self) -> dict | None:
        """``{"sequence", "layer_index", "row", "error"}`` of the worst row over everything
        (``layer_index`` indexes the compared layer list)."""
        best, best_key = None, -1.0
        for s, per_k in enumerate(self.worst_rows):
            for k, (r, e) in enumerate(per_k):
                key = float("inf") if e is None or not math.isfinite(e) else e
                if key > best_key:
                    best, best_key = {"sequence": s, "layer_index": k, "row": r, "error": e}, key
        return best

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
            "dtype": self.dtype, "tolerance": self.tolerance, "row_tolerance": self.row_tolerance,
            "passed": self.passed, "max_error": self.max_error, "worst_row": self.worst_row,
            "errors": self.errors, "worst_rows": self.worst_rows, "rows_over": self.rows_over,
            "row_quantiles": self.row_quantiles, "problems": self.problems,
        }

    def summary(self) -> str:
        status = "PASS" if self.passed else "FAIL"
        w = self.worst_row
        worst = (f"; worst row {w['error']:.3e} (seq {w['sequence']} layer#{w['layer_index']} row {w['row']},"
                 f" row bound {self.row_tolerance:.1e})") if w else ""
        lines = [f"{status}: max relative error {self.max_error:.3e} (tolerance "
                 f"{self.tolerance:.1e}, {self.dtype}){worst}"]
        lines += [f"  {p}" for p in self.problems]
        for s, k, e in self.failures():
            r, re_ = self.worst_rows[s][k]
            lines.append(
                f"  seq {s} layer#{k}: {e:.3e}; {self.rows_over[s][k]} rows over {self.row_tolerance:.1e},"
                f" worst row {r}: {re_:.3e}" if re_ is not None else f"  seq {s} layer#{k}: {e:.3e}"
            )
        return "\n".join(lines)

    def __bool__(self) -> bool:
        return self.passed


def compare(
    captured,
    reference,
    dtype: Any = "float32",
    tolerance: float | None = None,
    row_tolerance: float | None = None,
) -> CompareReport:
    """Compare ``captured[seq][k]`` with ``reference[seq][k]`` (both ``[len, hidden]``): the
    Frobenius error per (sequence, layer) and every row's own error (see :class:`CompareReport`).

    ``captured[seq]`` may also be a single tensor ``[len, n_layers, hidden]`` or
    ``[n_layers, len, hidden]`` stacked per sequence; it is split along the layer axis.
    """
    import torch

    name = _dtype_name(dtype)
    tol = TOLERANCE[name] if tolerance is None else float(tolerance)
    row_tol = ROW_TOLERANCE[name] if row_tolerance is None else float(row_tolerance)
    rep = CompareReport(dtype=name, tolerance=tol, row_tolerance=row_tol)
    if len(captured) != len(reference):
        rep.problems.append(f"{len(captured)} captured sequences vs {len(reference)} reference")
    all_rows = []
    nan = float("nan")
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
                rep.errors.append([nan] * len(ref_list))
                rep.worst_rows.append([[None, nan] for _ in ref_list])
                rep.rows_over.append([-1] * len(ref_list))
                continue
        else:
            cap_list = list(cap)
        if len(cap_list) != len(ref_list):
            rep.problems.append(f"seq {s}: {len(cap_list)} captured layers vs {len(ref_list)}")
        row, worst_row, over_row = [], [], []
        for k, (c, r) in enumerate(zip(cap_list, ref_list)):
            if tuple(c.shape) != tuple(r.shape):
                rep.problems.append(f"seq {s} layer#{k}: shape {tuple(c.shape)} vs {tuple(r.shape)}")
                row.append(nan)
                worst_row.append([None, nan])
                over_row.append(-1)
                continue
            row.append(relative_error(c, r))
            rows = _row_errors(c, r)
            if rows.numel():
                bad = ~(rows <= row_tol)  # NaN counts as bad
                finite = torch.nan_to_num(rows, nan=float("inf"))
                i = int(torch.argmax(finite))
                worst_row.append([i, float(rows[i])])
                over_row.append(int(bad.sum()))
                all_rows.append(rows)
            else:
                worst_row.append([None, 0.0])
                over_row.append(0)
        rep.errors.append(row)
        rep.worst_rows.append(worst_row)
        rep.rows_over.append(over_row)
    if all_rows:
        flat = torch.nan_to_num(torch.cat(all_rows), nan=float("inf"))
        qs = torch.quantile(flat[:1_000_000].double(), torch.tensor([0.5, 0.99, 0.999], dtype=torch.float64))
        rep.row_quantiles = {
            "rows": int(flat.numel()), "p50": float(qs[0]), "p99": float(qs[1]), "p99.9": float(qs[2]),
            "max": float(flat.max()),
        }
    return rep
