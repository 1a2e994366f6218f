"""Reading real signatures: what a callable accepts, said in words a probe can report."""

from __future__ import annotations

import functools
import inspect
from typing import Any

GENERATOR = "speculators.data_generation.vllm_hidden_states_generator"
WORKER = "speculators.data_generation.custom_worker"
EXECUTOR = "vllm.v1.executor.multiproc_executor"


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


class _Arg:
    """A stand-in argument for binding a declared call (never called)."""

    def __repr__(self) -> str:
        return "<arg>"


def _needs_self(module: str, attr: str, obj: Any) -> bool:
    """``Class.method`` read off the class: a plain function whose first parameter is the instance."""
    if "." not in attr:
        return False
    parent = import_attr(module, attr.rsplit(".", 1)[0])
    if not inspect.isclass(parent):
        return False
    try:
        raw = inspect.getattr_static(parent, attr.rsplit(".", 1)[1])
    except AttributeError:
        return False
    return not isinstance(raw, (staticmethod, classmethod)) and not inspect.ismethod(obj)


def bind_problem(call, obj: Any = None) -> str | None:
    """None if ``call`` (a registry.Call) binds to the installed callable, else a sentence naming
    the call, the installed signature and what does not bind (e.g. a new required parameter).

    ``obj``: the callable to bind against (default: ``call.module``'s ``call.attr``)."""
    if obj is None:
        try:
            obj = import_attr(call.module, call.attr)
        except (ImportError, AttributeError) as exc:
            if call.optional:
                return None
            return f"expected {call.target}; not found ({type(exc).__name__}: {exc})"
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return f"{call.target}: expected a callable with a readable signature; found {obj!r}"
    args = [_Arg() for _ in call.args]
    try:
        if _needs_self(call.module, call.attr, obj):
            args.insert(0, _Arg())
    except (ImportError, AttributeError):
        pass
    try:
        sig.bind(*args, **{k: _Arg() for k in call.kwargs})
    except TypeError as exc:
        return f"expected {call.describe()} to bind to {call.target}; found {describe(obj)} ({exc})"
    return None


def absent(call) -> bool:
    """An optional call whose target is not there: not called here."""
    if not call.optional:
        return False
    try:
        import_attr(call.module, call.attr)
    except (ImportError, AttributeError):
        return True
    return False


def first_binding(forms, obj: Any = None):
    """(the first of ``forms`` that binds, None) or (None, the problems of each, joined). An absent
    optional form counts only where no form's target is there (a present one is what is called)."""
    problems, missing = [], None
    for form in forms:
        if obj is None and absent(form):
            missing = missing or form
            continue
        problem = bind_problem(form, obj)
        if problem is None:
            return form, None
        problems.append(problem)
    if missing is not None and not problems:
        return missing, None
    return None, " / ".join(problems)


def for_speculators(call, speculators_version: str | None) -> bool:
    """Whether ``call`` applies to this speculators release (``Call.speculators``; any if unknown)."""
    if not call.speculators or not speculators_version:
        return True
    from packaging.specifiers import SpecifierSet

    from ..versions import in_range

    return in_range(speculators_version, SpecifierSet(call.speculators))


def calls_problem(specs, speculators_version: str | None = None) -> str | None:
    """None if every declared call binds (a spec: a Call, or a tuple of forms one of which must),
    else the first one's problem: a probe binds the ``calls`` its patch needs as ``check`` does."""
    for spec in specs:
        forms = tuple(f for f in (spec if isinstance(spec, tuple) else (spec,)) if for_speculators(f, speculators_version))
        problem = first_binding(forms)[1] if forms else None
        if problem:
            return problem
    return None
