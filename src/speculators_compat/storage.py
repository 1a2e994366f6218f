"""Opt-in FP8 storage of the script's data files (``SPECULATORS_COMPAT_STORE_DTYPE=fp8``).

Each captured row is stored as float8 e4m3 with one float32 scale per row and layer (the row's
largest magnitude maps to 448): half the bytes of bf16. An FP8 file holds ``hidden_states_fp8``
and ``hidden_states_scale`` instead of ``hidden_states``, so speculators' trainer without the
shim fails on it (KeyError) rather than training on unscaled values; under the shim the
``train-data-fp8`` patch decodes it before speculators' own ``standardize_fn``. Torch only.
"""

from __future__ import annotations

FORMAT_FP8 = "fp8_e4m3fn/row"
FP8_KEY = "hidden_states_fp8"
SCALE_KEY = "hidden_states_scale"
FORMAT_KEY = "speculators_compat_storage"
LAYOUT = (f"{FP8_KEY}: list of float8_e4m3fn [tokens, hidden] per layer; {SCALE_KEY}: float32 [tokens] "
          "per layer; row = fp8 * scale (read under speculators-compat: patch train-data-fp8)")
_FP8_MAX = 448.0
_CHOICES = {"auto": None, "fp8": FORMAT_FP8}


def chosen() -> str | None:
    """The storage format ``SPECULATORS_COMPAT_STORE_DTYPE`` asks for: None (as captured) or FP8."""
    from . import settings

    raw = (settings.text("SPECULATORS_COMPAT_STORE_DTYPE") or "auto").lower()
    if raw not in _CHOICES:
        raise settings.SettingError(f"SPECULATORS_COMPAT_STORE_DTYPE={raw!r}: expected auto or fp8")
    return _CHOICES[raw]


def quantize_rows(h):
    """(float8 e4m3 rows, float32 scale per row) of a [tokens, hidden] tensor: ``q * scale ≈ h``."""
    import torch

    amax = h.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-30)
    # the multiplier, rounded to h's dtype, stays below 448/amax: no product can pass 448
    inv = (_FP8_MAX * (1.0 - 2.0**-7) / amax).to(h.dtype)
    q = (h * inv).clamp_(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return q, (1.0 / inv.float()).squeeze(-1)


def dequantize_rows(q, scale, dtype=None):
    import torch

    return (q.to(torch.float32) * scale.unsqueeze(-1)).to(dtype or torch.float32)


def encode(obj: dict) -> dict:
    """A sample as the script saves it (``input_ids``, ``hidden_states`` list, ``loss_mask``), FP8-coded."""
    out = {k: v for k, v in obj.items() if k != "hidden_states"}
    pairs = [quantize_rows(h) for h in obj["hidden_states"]]
    out[FP8_KEY] = [q for q, _ in pairs]
    out[SCALE_KEY] = [s for _, s in pairs]
    out[FORMAT_KEY] = FORMAT_FP8
    return out


def decode(data: dict, dtype=None) -> dict:
    """A loaded sample with ``hidden_states`` as training reads it; a bf16 sample is returned as it is."""
    if FP8_KEY not in data:
        return data
    if data.get(FORMAT_KEY) != FORMAT_FP8:
        raise ValueError(f"expected {FORMAT_KEY}={FORMAT_FP8!r} in an FP8 data file; found {data.get(FORMAT_KEY)!r}")
    out = {k: v for k, v in data.items() if k not in (FP8_KEY, SCALE_KEY, FORMAT_KEY)}
    out["hidden_states"] = [dequantize_rows(q, s, dtype) for q, s in zip(data[FP8_KEY], data[SCALE_KEY])]
    return out


def row_errors(h, q, scale):
    """Relative error (norm of the difference / norm of the row) of each decoded row against ``h``."""
    ref = h.float()
    return (dequantize_rows(q, scale) - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)


def measured(obj: dict, encoded: dict) -> dict:
    """Per layer, the largest and the mean row error of ``encoded`` against the captured ``obj``."""
    errs = [row_errors(h, q, s) for h, q, s in zip(obj["hidden_states"], encoded[FP8_KEY], encoded[SCALE_KEY])]
    return {"max": [round(float(e.max()), 6) if e.numel() else 0.0 for e in errs],
            "mean": [round(float(e.mean()), 6) if e.numel() else 0.0 for e in errs],
            "rows": int(errs[0].numel()) if errs else 0}
