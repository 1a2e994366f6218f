"""Which code produced a result: the provenance block every result JSON carries.

``provenance()`` describes the checkout whose ``src/`` this very package was imported from
(the code that ran), not the current directory::

    {"commit":        "<HEAD commit of that checkout>",
     "dirty":         true/false,   # src/ or compat_matrix.yaml differ from that commit
     "src_tree":      "<git rev-parse <commit>:src>",  # the tree hash of src/ at that commit
     "matrix_sha256": "<sha256 of the compat_matrix.yaml the package reads>",
     "date_utc":      "2026-12-01T03:04:05Z",
     "command":       "python -m ... (relative paths only)",
     "host":          "<hostname>"}

``scripts/update_tested.py`` counts a result only when ``dirty`` is false, and calls it
``verified`` only while its ``src_tree`` equals ``git rev-parse HEAD:src`` (any change under
src/ makes older results stale; commits that touch only results or docs do not).

Outside a git checkout (an installed wheel, git missing) ``commit``/``dirty``/``src_tree`` are
``null`` and ``reason`` says why; such a result never counts as verified.

Machine paths are kept out: the command's arguments under the checkout are made relative to it,
other absolute paths are reduced to their last component.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

__all__ = ["provenance", "repo_root", "portable_command", "portable_path", "scrub_paths"]

# Machine folders a committed result must not name (tests/unit/test_portable_paths.py checks the
# committed files for these).
MACHINE_ROOTS = ("work", "root", "home", "tmp", "scratch")
_ABS = re.compile(r"(?<![\w.~-])/(?:" + "|".join(MACHINE_ROOTS) + r")(?:/[^\s'\"(),:;\]\[<>|`]*)?")

_PACKAGE = Path(__file__).resolve().parent.parent  # .../src/speculators_compat


def repo_root() -> Path | None:
    """The checkout whose src/ holds this package (None for an installed copy)."""
    src = _PACKAGE.parent
    root = src.parent
    if src.name == "src" and (root / "pyproject.toml").is_file():
        return root
    return None


def _git(root: Path, *args: str) -> str:
    proc = subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60
    )
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {(proc.stderr or proc.stdout).strip() or 'exit ' + str(proc.returncode)}")
    return proc.stdout


def _matrix_path() -> Path | None:
    try:
        from speculators_compat.matrix import matrix_path

        p = Path(matrix_path())
    except Exception:  # noqa: BLE001 - provenance never fails the run it describes
        return None
    return p if p.is_file() else None


def portable_path(path: str | os.PathLike, root: Path | None = None) -> str:
    """``path`` relative to the checkout when inside it, else its last component (no machine paths)."""
    p = Path(path)
    if not p.is_absolute():
        return str(path)
    root = root or repo_root()
    if root is not None:
        try:
            return str(p.resolve().relative_to(root.resolve()))
        except ValueError:
            pass
    return p.name


def portable_command(argv: list[str] | None = None, root: Path | None = None) -> str:
    """The command line with absolute paths made portable (``python -m module`` for module runs,
    ``python script.py`` for scripts)."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return "python"
    module = _module_name(argv[0])
    out = ["python", "-m", module] if module else ["python", portable_path(argv[0], root)]
    for a in argv[1:]:
        if a.startswith("--") and "=" in a:
            k, v = a.split("=", 1)
            out.append(f"{k}={portable_path(v, root)}")
        else:
            out.append(portable_path(a, root))
    return " ".join(shlex.quote(x) for x in out)


_CHECKOUT_DIRS = ("/src/speculators_compat", "/benchmarks/", "/scripts/", "/tests/", "/compat_matrix.yaml")


def _scrub_one(match: re.Match, root: Path | None) -> str:
    text = match.group(0)
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in text:
            return "<env>" + text[text.index(marker):]
    if root is not None:
        r = str(root.resolve())
        if text == r or text.startswith(r + "/"):
            return text[len(r) + 1:] or "."
    if "/.bed/" in text:  # a test bed (of this or another checkout)
        return ".bed/" + text.split("/.bed/", 1)[1]
    hits = [text.find(m) for m in _CHECKOUT_DIRS if m in text]
    if hits:  # inside some checkout of this repository: relative to it
        return text[min(hits) + 1:]
    name = text.rstrip("/").rsplit("/", 1)[-1]
    top = text.split("/")[1]
    return f"<{top}>/{name}" if text.rstrip("/").count("/") > 1 else f"<{top}>"


def scrub_paths(obj, root: Path | None = None):
    """``obj`` (str / list / dict, recursively) with absolute machine paths rewritten: inside the
    checkout relative to it, in an env from ``<env>/site-packages/...``, else ``<tmp>/name``."""
    root = root or repo_root()
    if isinstance(obj, str):
        return _ABS.sub(lambda m: _scrub_one(m, root), obj)
    if isinstance(obj, list):
        return [scrub_paths(x, root) for x in obj]
    if isinstance(obj, tuple):
        return tuple(scrub_paths(x, root) for x in obj)
    if isinstance(obj, dict):
        return {scrub_paths(k, root) if isinstance(k, str) else k: scrub_paths(v, root) for k, v in obj.items()}
    return obj


def _module_name(argv0: str) -> str | None:
    """``-m pkg.mod`` runs show the module's file as argv[0]; name it as a module again."""
    p = Path(argv0)
    try:
        rel = p.resolve().relative_to(_PACKAGE.parent)
    except (ValueError, OSError):
        return None
    if rel.suffix != ".py":
        return None
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__main__":
        parts = parts[:-1]
    return ".".join(parts)


def provenance(command: str | list[str] | None = None) -> dict:
    """The provenance block (see the module docstring). ``command``: a string, an argv list, or
    None (this process's ``sys.argv``)."""
    root = repo_root()
    if isinstance(command, str):
        cmd = command
    else:
        cmd = portable_command(command, root)
    matrix = _matrix_path()
    out: dict = {
        "commit": None,
        "dirty": None,
        "src_tree": None,
        "matrix_sha256": hashlib.sha256(matrix.read_bytes()).hexdigest() if matrix else None,
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": cmd,
        "host": socket.gethostname(),
    }
    if root is None:
        out["reason"] = f"speculators_compat is not imported from a source checkout ({_PACKAGE.name} is installed)"
        return out
    try:
        commit = _git(root, "rev-parse", "HEAD").strip()
        src_tree = _git(root, "rev-parse", f"{commit}:src").strip()
        paths = ["src"] + (["compat_matrix.yaml"] if (root / "compat_matrix.yaml").exists() else [])
        # tracked changes (staged or not) and untracked, non-ignored files under src/
        changed = [ln[3:] for ln in _git(root, "status", "--porcelain", "--untracked-files=all", "--", *paths).splitlines() if ln.strip()]
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        out["reason"] = f"no git information for the checkout: {type(exc).__name__}: {exc}"
        return out
    own = root / "compat_matrix.yaml"
    if matrix is not None and own.is_file() and matrix.read_bytes() != own.read_bytes():
        changed.append(f"matrix in use is not the checkout's compat_matrix.yaml ({matrix.name})")
    out.update(commit=commit, dirty=bool(changed), src_tree=src_tree)
    if changed:
        out["dirty_files"] = changed[:20]
    return out


if __name__ == "__main__":  # python -m speculators_compat.testing.provenance
    import json

    print(json.dumps(provenance(), indent=2))
