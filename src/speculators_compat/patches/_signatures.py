"""Reading real signatures: what a callable accepts, said in words a probe can report."""

from __future__ import annotations

import functools
import inspect
from typing import Any

GENERATOR = "speculators.data_generation.vllm_hidden_states_generator"
WORKER = "speculators.data_generation.custom_worker"


def parameters(obj: Any) -> dict[str, inspect.Parameter] | None:
    """Named parameters of a callable (classes: their constructor), or None if unreadable.

    Cached per object: adapters ask on every call (e.g. once per Request), signatures don't change.
    """
    try:
        return _cached_parameters(obj)
    except TypeError:  # unhashable callable
        return _read_parameters(obj)


def _read_parameters(obj: Any) -> dict[str, inspect.Parameter] | None:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    return dict(sig.parameters)


_cached_parameters = functools.lru_cache(maxsize=256)(_read_parameters)


def accepts(obj: Any, name: str) -> bool:
    params = parameters(obj) or {}
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def describe(obj: Any) -> str:
    name = getattr(obj, "__qualname__", type(obj).__name__)
    try:
        return f"{name}{inspect.signature(obj)}"
    except (TypeError, ValueError):
        return f"{name}(<signature unreadable>)"


def require_params(obj: Any, names: tuple[str, ...], what: str) -> str | None:
    """None if ``obj`` accepts every name, else an expected/found sentence."""
    params = parameters(obj)
    if params is None:
        return f"{what}: expected a callable with a readable signature; found {obj!r}"
    missing = [n for n in names if not accepts(obj, n)]
    if missing:
        return f"{what}: expected parameters {', '.join(names)}; found {describe(obj)} (missing {', '.join(missing)})"
    return None


def import_attr(module: str, attr: str) -> Any:
    """``module``'s attribute ``attr`` (dotted paths such as ``Class.method`` allowed)."""
    import importlib

    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
