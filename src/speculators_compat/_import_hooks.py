"""Post-import hooks: the one mechanism by which patches reach their target modules.

One finder at the front of ``sys.meta_path`` wraps the loader of each subscribed module and
calls its subscribers after the module's code has run. Subscriptions persist, so a retried
import (after a strict-mode refusal) is patched again. Imports only ``sys`` and ``_thread``:
``import speculators_compat`` stays cheap. Details: docs/MODULES.md.
"""

from __future__ import annotations

import sys
import _thread  # not threading: ~1 ms more at import (the C lock is the same)
from collections.abc import Callable

__all__ = ["ImportHooks", "HOOKS"]

Hook = Callable[[object], None]


class _HookedLoader:
    """Delegates to the real loader; calls the subscribers once the module's code has run."""

    def __init__(self, loader, hooks: ImportHooks):
        self._loader = loader
        self._hooks = hooks

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        # the module sees its real loader (reload(), inspect.getsource, pkgutil use it)
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self._loader
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self._loader
        self._loader.exec_module(module)
        self._hooks.notify(module)


class ImportHooks:
    """Subscribers per module name, and the meta-path finder that calls them."""

    def __init__(self) -> None:
        self._hooks: dict[str, list[Hook]] = {}
        self._lock = _thread.RLock()
        self._in_progress: set[str] = set()  # our own nested find_spec for one name

    # -- subscriptions ---------------------------------------------------------------------
    def subscribe(self, name: str, hook: Hook) -> None:
        """Call ``hook(module)`` each time module ``name`` is executed by an import from now on
        (not for a module already imported: the caller handles ``sys.modules`` itself).
        Subscribing the same hook twice is a no-op."""
        with self._lock:
            hooks = self._hooks.setdefault(name, [])
            if hook not in hooks:
                hooks.append(hook)
            if self not in sys.meta_path:
                sys.meta_path.insert(0, self)

    def unsubscribe(self, name: str, hook: Hook) -> None:
        with self._lock:
            hooks = self._hooks.get(name, [])
            if hook in hooks:
                hooks.remove(hook)
            if not hooks:
                self._hooks.pop(name, None)
            if not self._hooks and self in sys.meta_path:
                sys.meta_path.remove(self)

    def subscribed(self) -> dict[str, int]:
        """{module name: number of subscribers} (for reports and tests)."""
        with self._lock:
            return {name: len(hooks) for name, hooks in self._hooks.items()}

    def notify(self, module) -> None:
        """Run the subscribers of ``module`` (a snapshot: a hook may subscribe others)."""
        with self._lock:
            hooks = list(self._hooks.get(getattr(module, "__name__", ""), ()))
        for hook in hooks:
            hook(module)

    # -- the finder ------------------------------------------------------------------------
    def find_spec(self, fullname, path=None, target=None):
        with self._lock:
            if fullname not in self._hooks or fullname in self._in_progress:
                return None
            self._in_progress.add(fullname)
        try:
            import importlib.util

            spec = importlib.util.find_spec(fullname)
        except (ImportError, ValueError):
            return None
        finally:
            with self._lock:
                self._in_progress.discard(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module") or isinstance(loader, _HookedLoader):
            return None  # the normal finders handle it (a legacy loader: no hook)
        spec.loader = _HookedLoader(loader, self)
        return spec


HOOKS = ImportHooks()  # the process-wide instance every registry subscribes to
