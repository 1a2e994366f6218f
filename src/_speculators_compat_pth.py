"""Run by ``speculators_compat_auto.pth`` at every interpreter start of the environment.

Off by default and cheap: the .pth line imports this module only when ``SPECULATORS_COMPAT_AUTO``
is in the environment (otherwise it costs one dictionary lookup). When it is set,
speculators-compat's settings parser decides (1/true/yes/on: activate;
0/false/no/off: nothing; anything else: one line on stderr, nothing activated) — the package is
imported only to activate, since importing it is what activates the shim. Nothing here may stop
the interpreter from starting.
"""

import os as _os

_NAME = "SPECULATORS_COMPAT_AUTO"


def _settings_module():
    """speculators_compat.settings without importing the package (whose import activates)."""
    import importlib.util

    spec = importlib.util.find_spec("speculators_compat")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = _os.path.join(list(spec.submodule_search_locations)[0], "settings.py")
    settings_spec = importlib.util.spec_from_file_location("_speculators_compat_pth_settings", path)
    module = importlib.util.module_from_spec(settings_spec)
    import sys

    sys.modules[settings_spec.name] = module  # dataclasses look their module up there
    try:
        settings_spec.loader.exec_module(module)
    finally:
        del sys.modules[settings_spec.name]
    return module


def _main():
    if _NAME not in _os.environ:
        return
    import sys

    try:
        settings = _settings_module()
        if settings is None or not settings.flag(_NAME):
            return
        import speculators_compat  # noqa: F401  (importing activates)
    except Exception as exc:  # noqa: BLE001 - never break interpreter start-up
        sys.stderr.write(f"speculators_compat: {_NAME}: not activated: {type(exc).__name__}: {exc}\n")


_main()
