"""Put on ``PYTHONPATH`` by ``speculators-compat run``: activates the shim at interpreter start.

Python imports ``sitecustomize`` once, from the first folder on ``sys.path`` that has one; this
folder comes first, so the environment's own ``sitecustomize`` (if any) is then located on the rest
of ``sys.path`` and executed too, under its own name. Nothing here may stop the interpreter from
starting: a failure is one line on stderr.
"""


def _activate():
    try:
        import speculators_compat  # noqa: F401  (importing activates: a cheap import trigger)
    except Exception as exc:  # noqa: BLE001 - never break interpreter start-up
        import sys

        sys.stderr.write(f"speculators_compat: not activated by `speculators-compat run`: {type(exc).__name__}: {exc}\n")


def _chain():
    """Run the next ``sitecustomize`` on ``sys.path`` (the one this file shadows)."""
    import importlib.machinery
    import importlib.util
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    ours = sys.modules.get("sitecustomize")
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - as site.py does: report, keep starting
        sys.stderr.write(f"Error in sitecustomize ({spec.origin}); set PYTHONVERBOSE for traceback:\n{type(exc).__name__}: {exc}\n")
        if ours is not None:
            sys.modules["sitecustomize"] = ours


_activate()
_chain()
