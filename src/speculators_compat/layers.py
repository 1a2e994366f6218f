"""Per-architecture decoder-layer adapters: where the residual stream is after layer i.

The shim keeps the model's own forward and reads each chosen layer's output with a forward hook;
an adapter knows only how a layer class returns the residual stream (fused-residual layers:
``hidden_states + residual``). Classes verified against HF are listed; others with the
fused-residual signature are accepted and logged; anything else is a clear error naming the
class. Details: docs/MODULES.md.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("speculators_compat")

__all__ = ["LayerAdapter", "ADAPTERS", "adapter_for", "UnknownLayerError", "find_decoder_stack"]


class UnknownLayerError(TypeError):
    """No adapter knows this decoder layer's calling convention."""


def _fused_residual(output):
    hidden_states, residual = output
    return hidden_states if residual is None else hidden_states + residual


@dataclass(frozen=True)
class LayerAdapter:
    name: str
    residual_stream: Callable  # layer output -> tensor [tokens, hidden]
    required: tuple[str, ...]  # parameters the layer's forward must have

    def check_output(self, layer_cls: type, output) -> None:
        ok = (
            isinstance(output, tuple)
            and len(output) == 2
            and hasattr(output[0], "shape")
            and (output[1] is None or getattr(output[1], "shape", None) == output[0].shape)
        )
        if not ok:
            found = type(output).__name__
            if isinstance(output, tuple):
                found += "(" + ", ".join(type(o).__name__ + str(tuple(getattr(o, "shape", ()))) for o in output) + ")"
            raise UnknownLayerError(
                f"{layer_cls.__qualname__} (adapter {self.name}): expected the layer to return "
                f"(hidden_states, residual) of equal shapes; found {found}"
            )


FUSED_RESIDUAL = LayerAdapter("fused-residual", _fused_residual, ("hidden_states", "residual"))

# model_type-free: keyed by the decoder layer's class name, as vLLM defines it.
ADAPTERS: dict[str, LayerAdapter] = {
    "LlamaDecoderLayer": FUSED_RESIDUAL,
    "MistralDecoderLayer": FUSED_RESIDUAL,
    "Qwen2DecoderLayer": FUSED_RESIDUAL,
    "Qwen3DecoderLayer": FUSED_RESIDUAL,
    "Qwen3MoeDecoderLayer": FUSED_RESIDUAL,
    "DeepseekV2DecoderLayer": FUSED_RESIDUAL,
    "DeepseekV3DecoderLayer": FUSED_RESIDUAL,
    "TransformerBlock": FUSED_RESIDUAL,  # gpt_oss
    "Gemma3DecoderLayer": FUSED_RESIDUAL,
}


def _signature(layer_cls: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(layer_cls.forward)
    except (TypeError, ValueError, AttributeError):
        return None


def adapter_for(layer_cls: type) -> LayerAdapter:
    """The adapter for a decoder layer class, from its real forward signature."""
    sig = _signature(layer_cls)
    shown = f"{layer_cls.__module__}.{layer_cls.__qualname__}.forward{sig}" if sig else f"{layer_cls.__qualname__} (no readable forward)"
    params = set(sig.parameters) if sig else set()
    adapter = ADAPTERS.get(layer_cls.__name__)
    if adapter is not None:
        missing = [p for p in adapter.required if p not in params]
        if missing:
            raise UnknownLayerError(
                f"{shown}: adapter {adapter.name} expects parameters {', '.join(adapter.required)}; "
                f"missing {', '.join(missing)}"
            )
        return adapter
    if all(p in params for p in FUSED_RESIDUAL.required):
        logger.info("speculators_compat: %s is not in the adapter table; its signature is fused-residual: %s", layer_cls.__name__, shown)
        return FUSED_RESIDUAL
    raise UnknownLayerError(
        f"no decoder-layer adapter for {shown}: expected a known class "
        f"({', '.join(sorted(ADAPTERS))}) or a forward(..., hidden_states, residual) returning "
        "(hidden_states, residual)"
    )


def find_decoder_stack(model):
    """(inner model, its decoder layers) of a vLLM CausalLM, multimodal wrappers included."""
    candidates = []
    getter = getattr(model, "get_language_model", None)
    if callable(getter):
        try:
            candidates.append(getter())
        except Exception:  # noqa: BLE001 - some wrappers raise when text-only; fall through
            pass
    candidates.append(model)
    for outer in candidates:
        for inner in (getattr(outer, "model", None), getattr(getattr(outer, "language_model", None), "model", None), outer):
            layers = getattr(inner, "layers", None)
            if inner is not None and layers is not None and hasattr(layers, "__len__"):
                return inner, layers
    attrs = [a for a in dir(model) if not a.startswith("_")][:40]
    raise UnknownLayerError(
        f"cannot find the decoder layers of {type(model).__qualname__}: expected .model.layers "
        f"(or get_language_model().model.layers); attributes found: {', '.join(attrs)}"
    )
