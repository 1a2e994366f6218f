"""``speculators-compat run <command…>``: run a command with the shim active in every Python process.

Like ``ddtrace-run``, the launcher prepends ``speculators_compat/_boot`` (a ``sitecustomize.py``
that activates the shim, then runs the environment's own) to ``PYTHONPATH`` and ``exec``s the
command: the command, vLLM's workers and spawn children all start with the shim; the exit code,
signals and stdio are the command's. ``SPECULATORS_COMPAT_AUTO=1`` does it for every process.

Details: docs/MODULES.md.
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
