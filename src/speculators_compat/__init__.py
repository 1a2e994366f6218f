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
import sys

__version__ = "0.1.0"

__all__ = ["__version__", "activate", "deactivate", "report", "context_line", "get_registry"]

_registry = None
_config: tuple[bool, str | None] = (False, None)  # (strict, selection) of the last activate()
_front_hooked = False
_activation_requested = False

# The modules whose import triggers patches (each patch's ``hook_module``; a unit test keeps
# this list equal to the patches'). ``import speculators_compat`` only installs a one-shot
# import trigger for these (_trigger.py): the registry, wrapt, the patch definitions, the matrix
# (yaml) and version parsing (packaging) are loaded when the first of them is imported.
HOOK_MODULES = (
    "transformers",
    "transformers.configuration_utils",
    "vllm.utils",
    "speculators.data_generation.vllm_hidden_states_generator",
    "speculators.data_generation.custom_worker",
    "speculators.data_generation.config_generator",
)


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
        reg.configure(strict=_config[0], selection=_config[1])
        _registry = reg
        if _activation_requested:  # activate() ran before the registry existed
            reg.activate()
    return _registry


def _env_flag(name: str) -> bool:
    from . import settings

    return settings.flag(name)


def activate(strict: bool | None = None, patches: str | None = None) -> bool:
    """Activate the patches: they apply when their targets are imported (at once if already).

    Safe to call many times. ``strict``/``patches`` default to the environment; values given
    here are written back to the environment so that vLLM's worker processes see them too.
    Returns False when disabled by ``SPECULATORS_COMPAT_DISABLE``.
    """
    global _config, _activation_requested
    if _env_flag("SPECULATORS_COMPAT_DISABLE"):
        return False
    if strict is None:
        strict = _env_flag("SPECULATORS_COMPAT_STRICT")
    else:
        os.environ["SPECULATORS_COMPAT_STRICT"] = "1" if strict else "0"
    if patches is None:
        from . import settings

        patches = settings.text("SPECULATORS_COMPAT_PATCHES")
    else:
        os.environ["SPECULATORS_COMPAT_PATCHES"] = patches
    _config = (strict, patches)
    _activation_requested = True
    if _registry is not None or (patches and patches.strip()):
        _activate_registry()  # re-apply now / validate the selection now
    else:
        _hook_front()
    return True


def _hook_front() -> None:
    global _front_hooked
    if _front_hooked:
        return
    imported = [m for m in HOOK_MODULES if m in sys.modules]
    if imported:  # a target is already here: build the registry now
        _front_hook(sys.modules[imported[0]])
        return
    from ._trigger import TriggerFinder

    TriggerFinder(HOOK_MODULES, _front_hook).install()
    _front_hooked = True


def _front_hook(module) -> None:
    if not _activation_requested:
        return  # deactivate() ran after the trigger was installed
    if _registry is not None and _registry.active:
        return  # the registry's own hooks handle it
    try:
        _activate_registry()
    except Exception as exc:  # noqa: BLE001 - never break the target's import (strict: below)
        import warnings

        warnings.warn(f"speculators_compat: activation failed: {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)
        if _config[0]:
            raise


def _activate_registry() -> None:
    reg = get_registry()
    reg.configure(strict=_config[0], selection=_config[1])
    reg.activate()


def deactivate() -> None:
    """Revert every applied patch (the original objects are put back) and stop applying."""
    global _activation_requested
    _activation_requested = False
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
