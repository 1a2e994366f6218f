"""``speculators-compat run <command…>``: run a command with the shim active in every Python process.

speculators' own scripts (``scripts/data_generation_offline.py``) never import
``speculators_compat``, force ``spawn`` for vLLM's workers and ``multiprocessing``, and import
``speculators`` at their top level — which on transformers 5 already needs the shim. A wrapper
that imports the shim and then runs the script helps only the first process: a spawned child
re-imports the main module before vLLM loads its plugins. So, like ``ddtrace-run`` or
``opentelemetry-instrument``, the launcher prepends the folder ``speculators_compat/_boot`` (it
holds only a ``sitecustomize.py``) to ``PYTHONPATH`` and ``exec``s the command. Every Python
process started from there on — the command, vLLM's workers, ``multiprocessing`` spawn children —
inherits ``PYTHONPATH`` and runs that ``sitecustomize`` at startup, which activates the shim (a
cheap import trigger, nothing heavy) and then runs the environment's own ``sitecustomize`` if
there is one. The command replaces this process (``os.execvp``): its exit code, signals and
stdin/stdout are the command's own.

Without the launcher: ``SPECULATORS_COMPAT_AUTO=1`` makes the ``.pth`` hook shipped in the wheel
activate the shim at every interpreter start of that environment (see
``_speculators_compat_pth.py``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

BOOT_DIR = Path(__file__).resolve().parent / "_boot"
USAGE = "usage: speculators-compat run <command> [args...]   e.g. speculators-compat run python data_generation_offline.py ..."


def child_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The command's environment: ``PYTHONPATH`` starts with the boot folder (once)."""
    env = dict(os.environ if environ is None else environ)
    boot = str(BOOT_DIR)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != boot]
    env["PYTHONPATH"] = os.pathsep.join([boot, *parts])
    return env


def run(command: list[str]) -> int:
    """Exec ``command`` with the boot folder on ``PYTHONPATH``; returns only on failure (exit code)."""
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print(f"speculators-compat run: no command given ({USAGE})", file=sys.stderr)
        return 2
    if command[0] in ("-h", "--help"):
        print(USAGE)
        print(__doc__.split("\n\n")[1])
        return 0
    env = child_environment()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, env)
    except FileNotFoundError:
        print(f"speculators-compat run: command not found: {command[0]}", file=sys.stderr)
        return 127
    except PermissionError as exc:
        print(f"speculators-compat run: cannot execute {command[0]}: {exc.strerror}", file=sys.stderr)
        return 126
    except OSError as exc:
        print(f"speculators-compat run: cannot execute {command[0]}: {exc}", file=sys.stderr)
        return 126
    return 0  # not reached: exec replaced this process
