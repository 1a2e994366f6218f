"""speculators-compat: version-gated patches that keep speculators' offline EAGLE-3 data
generator (``VllmHiddenStatesGenerator``) and its vLLM worker extension working on new vLLM.

``import speculators_compat`` before speculators activates the shim. It imports neither torch,
vLLM nor speculators: patches are applied by post-import hooks when their targets are imported.
In vLLM's own processes (engine core, workers) the ``vllm.general_plugins`` entry point does the
same. Environment:

- ``SPECULATORS_COMPAT_DISABLE=1``: do nothing.
- ``SPECULATORS_COMPAT_STRICT=1``: an untested combination or a failed probe raises.
- ``SPECULATORS_COMPAT_PATCHES``: ``id1,id2`` (only these; a failure of one raises) or
  ``-id1,-id2`` (all but these).
- ``SPECULATORS_COMPAT_MATRIX``: path of a user's own compat matrix (validated like ours).
"""

from __future__ import annotations

import os

__version__ = "0.1.0"

__all__ = ["__version__", "activate", "deactivate", "report", "context_line", "get_registry"]

_registry = None


def get_registry():
    """The process-wide registry with every patch this package defines (built once)."""
    global _registry
    if _registry is None:
        from .matrix import load_matrix
        from .patches import all_patches
        from .registry import Registry
        from .versions import installed_versions

        reg = Registry(matrix_loader=lambda ids: load_matrix(known_ids=ids), versions_reader=installed_versions)
        for patch in all_patches():
            reg.register(patch)
        _registry = reg
    return _registry


def activate(strict: bool | None = None, patches: str | None = None) -> bool:
    """Register the patches' import hooks (apply at once to targets already imported).

    Safe to call many times. ``strict``/``patches`` default to the environment; values given
    here are written back to the environment so that vLLM's worker processes see them too.
    Returns False when disabled by ``SPECULATORS_COMPAT_DISABLE``.
    """
    from .registry import env_flag

    if env_flag("SPECULATORS_COMPAT_DISABLE"):
        return False
    if strict is None:
        strict = env_flag("SPECULATORS_COMPAT_STRICT")
    else:
        os.environ["SPECULATORS_COMPAT_STRICT"] = "1" if strict else "0"
    if patches is None:
        patches = os.environ.get("SPECULATORS_COMPAT_PATCHES")
    else:
        os.environ["SPECULATORS_COMPAT_PATCHES"] = patches
    reg = get_registry()
    reg.configure(strict=strict, selection=patches)
    reg.activate()
    return True


def deactivate() -> None:
    """Revert every applied patch (the original objects are put back) and stop applying."""
    if _registry is not None:
        _registry.deactivate()


def report() -> list[dict]:
    """One record per patch: id, family, target, status, reason, versions."""
    return [s.as_dict() for s in get_registry().statuses()]


def context_line() -> str:
    """Versions and applied patches, for error messages."""
    reg = get_registry()
    v = reg.version_strings()
    applied = ", ".join(reg.applied_ids()) or "none"
    return (
        f"speculators-compat {__version__}: speculators {v.get('speculators')}, vllm {v.get('vllm')}, "
        f"transformers {v.get('transformers')}, torch {v.get('torch')}; patches applied here: {applied}"
    )


def _auto_activate() -> None:
    try:
        activate()
    except ValueError as exc:  # bad SPECULATORS_COMPAT_PATCHES: a clear one-line error
        raise ValueError(f"speculators_compat: {exc}") from None


_auto_activate()
