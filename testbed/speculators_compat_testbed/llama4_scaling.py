"""``llama_4_scaling`` (Mistral-Large-3 style) for the DeepSeek-V3 e2e cells.

From vLLM 0.12, ``DeepseekV2Model.forward`` (vllm/model_executor/models/deepseek_v2.py) reads
``config.llama_4_scaling = {"original_max_position_embeddings": N, "beta": b}`` (a top-level
key of config.json; vLLM's Mistral-format converter writes the same key), computes, per token,

    scale(pos) = 1 + b * log(1 + floor(pos / N))

once per forward, and passes it to every decoder layer as the fourth argument
(``layer(positions, hidden_states, residual, llama_4_scaling)``); the attention multiplies
the whole query (nope and rope parts, after rotary) by it. Positions below N get 1.
A capture loop that calls the layers itself without that argument is silently wrong for
every token at or beyond N.

HF transformers' DeepseekV3 (4.57, 5.19) does not implement it: its forward ignores the key.
The references for such a config are therefore:

- ``vllm``: the same vLLM engine's own forward, shim disabled, forward hooks on the decoder
  layers (:mod:`speculators_compat_testbed.vllm_reference`);
- ``hf+harness``: HF with the scaling applied by :func:`hf_attention_scaling` (the formula
  above, written here, independent of vLLM's code);
- negative controls: plain HF (no scaling) and vLLM's own forward with
  ``config.llama_4_scaling`` set to None in the worker (what a loop that omits it computes).

Pure-python helpers import nothing heavy; torch is imported inside functions.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from pathlib import Path

__all__ = [
    "KEYS",
    "config_value",
    "factor",
    "hf_attention_scaling",
    "hf_implements",
    "stats",
]

KEYS = ("original_max_position_embeddings", "beta")


def config_value(model_dir: str | Path) -> dict | None:
    """The checkpoint's ``llama_4_scaling`` dict (as vLLM reads it), or None when unset.

    Raises ValueError when set without the two keys vLLM indexes (it would raise KeyError)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else None
    value = cfg.get("llama_4_scaling", (text or {}).get("llama_4_scaling"))
    if value is None:
        return None
    if not isinstance(value, dict) or any(k not in value for k in KEYS):
        raise ValueError(f"llama_4_scaling must be a dict with keys {KEYS}; found {value!r}")
    return {k: value[k] for k in KEYS}


def factor(position: int, original_max_position_embeddings: int, beta: float) -> float:
    """vLLM's ``_get_llama_4_scaling`` for one position (pure python)."""
    return 1.0 + beta * math.log(1 + math.floor(position / original_max_position_embeddings))


def stats(lengths, value: dict) -> dict:
    """How many of the tokens of sequences of ``lengths`` (positions 0..n-1) get a factor != 1."""
    n0, beta = int(value["original_max_position_embeddings"]), float(value["beta"])
    total = sum(int(n) for n in lengths)
    unscaled = sum(min(int(n), n0) for n in lengths) if beta != 0 else total
    longest = max((int(n) for n in lengths), default=0)
    return {
        "tokens": total,
        "tokens_scaled": total - unscaled,
        "fraction_scaled": (total - unscaled) / total if total else 0.0,
        "min_factor": 1.0 if unscaled or not total else factor(0, n0, beta),
        "max_factor": factor(longest - 1, n0, beta) if longest else 1.0,
    }


def hf_implements(model) -> bool:
    """Whether the HF model's own code reads ``llama_4_scaling`` (source of its modeling module)."""
    import inspect

    mod = sys.modules.get(type(model).__module__)
    try:
        src = inspect.getsource(mod) if mod is not None else ""
    except (OSError, TypeError):
        return False
    return "llama_4_scaling" in src


@contextlib.contextmanager
def hf_attention_scaling(model, value: dict):
    """Apply ``llama_4_scaling`` to an HF DeepseekV3 model run with eager attention.

    Wraps the modeling module's ``eager_attention_forward`` (both transformers 4.57 and 5.19
    call the module global for ``attn_implementation="eager"``) so the query - already the
    concatenation of the nope and rotated parts, as in vLLM - is multiplied by the factor of
    its position. Positions are 0..q_len-1: only for batch-1 runs without a KV cache (what
    ``reference.hf_layer_outputs`` does)."""
    import torch

    mod = sys.modules[type(model).__module__]
    original = getattr(mod, "eager_attention_forward")
    n0, beta = int(value["original_max_position_embeddings"]), float(value["beta"])
    calls = {"n": 0}

    def scaled(module, query, key, value_states, attention_mask, scaling, *args, **kwargs):
        q_len = query.shape[-2]
        if key.shape[-2] != q_len:
            raise RuntimeError("hf_attention_scaling: positions are known only without a KV cache")
        pos = torch.arange(q_len, device=query.device, dtype=torch.float32)
        s = 1 + beta * torch.log(1 + torch.floor(pos / n0))
        calls["n"] += 1
        return original(module, query * s.to(query.dtype)[:, None], key, value_states, attention_mask, scaling,
                        *args, **kwargs)

    setattr(mod, "eager_attention_forward", scaled)
    try:
        yield calls
    finally:
        setattr(mod, "eager_attention_forward", original)
