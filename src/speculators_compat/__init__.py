"""speculators-compat: version-gated patches that keep speculators' offline EAGLE-3 data
generator (``VllmHiddenStatesGenerator``) and its vLLM worker extension working on new vLLM.

``import speculators_compat`` before speculators activates the shim; it imports neither torch,
vLLM nor speculators (patches apply by post-import hooks). vLLM's processes activate it through
the ``vllm.general_plugins`` entry point. Settings: ``settings.py`` (README's table).
"""

from __future__ import annotations

import os
import sys
import _thread  # not threading: ~1 ms more at import (the C lock is the same)

__version__ = "0.1.0"

__all__ = ["__version__", "activate", "deactivate", "report", "context_line", "get_registry"]

# The modules whose import triggers patches (each patch's ``hook_module``; a unit test keeps
# this list equal to the patches'). ``import speculators_compat`` only subscribes a lazy hook to
# these (``_import_hooks``: one meta-path finder, standard library only): the registry, wrapt,
# the patch definitions, the matrix (yaml) and version parsing (packaging) are loaded when the
# first of them is imported; the registry then subscribes its own hooks through the same finder.
HOOK_MODULES = (
    "transformers",
    "transformers.configuration_utils",
    "vllm.utils",
    "vllm.v1.core.kv_cache_utils",
    "speculators.data_generation.vllm_hidden_states_generator",
    "speculators.data_generation.custom_worker",
    "vllm.v1.worker.gpu.model_runner",
    "speculators.data_generation.config_generator",
    "speculators.data_generation.preprocessing",
    "vllm.v1.executor.multiproc_executor",
    "speculators.train.data",
)


class _Activation:
    """All activation state of the process, in one place.

    ``requested``: ``activate()`` ran and ``deactivate()`` did not follow; ``strict`` and
    ``selection``: the configuration of the last ``activate()``; ``registry``: built on first
    need (``get_registry()``, the first target import, or a selection to validate), without
    activating anything; ``lazy``: whether the lazy hook is subscribed (until the registry
    is active and holds its own hooks).
    """

    def __init__(self) -> None:
        self.requested = False
        self.strict = False
        self.selection: str | None = None
        self.registry = None
        self.lazy = False
        self._lock = _thread.RLock()

    def get_registry(self):
        with self._lock:
            if self.registry is None:
                from .matrix import load_matrix
                from .patches import all_patches
                from .registry import Registry
                from .versions import installed_versions

                reg = Registry(
                    matrix_loader=lambda ids: load_matrix(known_ids=ids), versions_reader=installed_versions
                )
                for patch in all_patches():
                    reg.register(patch)
                reg.configure(strict=self.strict, selection=self.selection)
                self.registry = reg
            return self.registry

    def activate(self, strict: bool, selection: str | None) -> None:
        before = (self.strict, self.selection, self.requested)
        self.strict, self.selection, self.requested = strict, selection, True
        if self.registry is not None or (selection and selection.strip()) or any(m in sys.modules for m in HOOK_MODULES):
            try:
                self.start()  # re-apply now / validate the selection now / a target is already here
            except ValueError:  # a refused selection leaves the earlier configuration in place
                self.strict, self.selection, self.requested = before
                raise
        else:
            self._subscribe_lazy()

    def start(self) -> None:
        """Configure and activate the registry (it then holds its own hooks)."""
        reg = self.get_registry()
        reg.configure(strict=self.strict, selection=self.selection)
        self._unsubscribe_lazy()
        reg.activate()

    def deactivate(self) -> None:
        self.requested = False
        self._unsubscribe_lazy()
        if self.registry is not None:
            self.registry.deactivate()

    # -- the lazy hook: the first target import builds and activates the registry -----------
    def _subscribe_lazy(self) -> None:
        from ._import_hooks import HOOKS

        for name in HOOK_MODULES:
            HOOKS.subscribe(name, self._on_first_target)
        self.lazy = True

    def _unsubscribe_lazy(self) -> None:
        if not self.lazy:
            return
        from ._import_hooks import HOOKS

        for name in HOOK_MODULES:
            HOOKS.unsubscribe(name, self._on_first_target)
        self.lazy = False

    def _on_first_target(self, module) -> None:
        if not self.requested or (self.registry is not None and self.registry.active):
            return
        try:
            self.start()
        except Exception as exc:  # noqa: BLE001 - never break the target's import (strict: below)
            import warnings

            warnings.warn(
                f"speculators_compat: activation failed: {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2
            )
            if self.strict:
                raise


_STATE = _Activation()


def get_registry():
    """The process-wide registry with every patch this package defines (built once, not
    activated: activation is ``activate()``'s, which the package import runs)."""
    return _STATE.get_registry()


def activate(strict: bool | None = None, patches: str | None = None) -> bool:
    """Activate the patches: they apply when their targets are imported (at once if already).

    Safe to call many times. ``strict``/``patches`` default to the environment; values given
    here are written back to the environment so that vLLM's worker processes see them too.
    Returns False when disabled by ``SPECULATORS_COMPAT_DISABLE``.
    """
    from . import settings

    if settings.flag("SPECULATORS_COMPAT_DISABLE"):
        return False
    if strict is None:
        strict = settings.flag("SPECULATORS_COMPAT_STRICT")
    else:
        os.environ["SPECULATORS_COMPAT_STRICT"] = "1" if strict else "0"
    if patches is None:
        patches = settings.text("SPECULATORS_COMPAT_PATCHES")
    else:
        os.environ["SPECULATORS_COMPAT_PATCHES"] = patches
    _STATE.activate(strict, patches)
    return True


def deactivate() -> None:
    """Revert every applied patch (the original objects are put back) and stop applying."""
    _STATE.deactivate()


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


def _cli_process() -> bool:
    """True when this process is the ``speculators-compat`` command (console script or ``-m``)."""
    argv = list(getattr(sys, "orig_argv", None) or ())
    if "-m" in argv:
        return argv[argv.index("-m") + 1 : argv.index("-m") + 2] in (["speculators_compat"], ["speculators_compat.cli"])
    return any(os.path.basename(a) == "speculators-compat" for a in argv[:2])


def _auto_activate() -> None:
    try:
        activate()
    except ValueError as exc:  # bad SPECULATORS_COMPAT_PATCHES: a clear one-line error
        if _cli_process():
            return  # the command reports it (check/report: one line, exit 3), not a traceback at import
        raise ValueError(f"speculators_compat: {exc}") from None


_auto_activate()
