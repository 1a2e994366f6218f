"""A minimal one-shot import trigger, so that ``import speculators_compat`` stays cheap.

wrapt 2.x imports asyncio, importlib.metadata, email … (tens of milliseconds: measured with
``-X importtime``). The package import must cost ~nothing, so it installs only this finder:
when the first of the patch target modules is imported, the finder lets the normal finders
locate it, runs its loader, and then calls ``on_loaded(module)`` — which builds the registry
(wrapt, yaml, packaging, the patch definitions) and hands over to wrapt's post-import hooks.
The finder removes itself after the first trigger.
"""

from __future__ import annotations

import sys


class _LoaderProxy:
    """Delegates to the real loader; calls back after the module has executed."""

    def __init__(self, loader, callback):
        self._loader = loader
        self._callback = callback

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._callback(module)


class TriggerFinder:
    def __init__(self, names: tuple[str, ...], on_loaded):
        self._names = frozenset(names)
        self._on_loaded = on_loaded
        self._busy = False  # our own nested find_spec (imports of one module are serialised)
        self.fired = False

    def find_spec(self, fullname, path=None, target=None):
        if self.fired or self._busy or fullname not in self._names:
            return None
        import importlib.util

        self._busy = True
        try:
            spec = importlib.util.find_spec(fullname)
        except (ImportError, ValueError):
            return None
        finally:
            self._busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _LoaderProxy(spec.loader, self._fire)
        return spec

    def _fire(self, module):
        if self.fired:
            return
        self.fired = True
        self.remove()
        self._on_loaded(module)

    def install(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def remove(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
