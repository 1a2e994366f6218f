"""Which code produced a result: the provenance block every result JSON carries.

``provenance()`` describes the checkout whose ``src/`` the runtime package ``speculators_compat``
was imported from (the code that ran), not the current directory::

    {"commit":        "<HEAD commit of that checkout>",
     "dirty":         true/false,   # src/, testbed/ or compat_matrix.yaml differ from that commit
     "src_tree":      "<git rev-parse <commit>:src>",  # the runtime's tree hash at that commit
     "testbed_tree":  "<git rev-parse <commit>:testbed>",  # the test bed's (judges, does not run)
     "matrix_sha256": "<sha256 of the compat_matrix.yaml the package reads>",
     "date_utc":      "2026-12-01T03:04:05Z",
     "command":       "python -m ... (relative paths only)",
     "host":          "<hostname>",
     "machine":       {"cpu": "<model name>", "cpu_flags": "amx_bf16 ... avx2", "cpus": 2, "gpu": "..."}}

``scripts/update_tested.py`` counts a result only when ``dirty`` is false, and calls it
``verified`` only while its ``src_tree`` equals ``git rev-parse HEAD:src`` (any change under
src/ makes older results stale; commits that touch only the test bed, results or docs do not:
the test bed's tree is recorded beside it).

Outside a git checkout (an installed wheel, git missing) ``commit``/``dirty``/``src_tree`` are
``null`` and ``reason`` says why; such a result never counts as verified. One exception: a copy of
the checkout without ``.git`` (the GPU machine gets the work tree only) that carries
``.checkout.json`` (written by ``python -m speculators_compat_testbed.provenance --stamp`` before
the copy: the commit, its src and testbed trees). There the tree hashes of the files under ``src/``
and ``testbed/`` are computed as git would (``src_tree_from: "files"``) and ``dirty`` is whether
either differs from the stamp's.

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
import stat
import subprocess
import sys
from pathlib import Path

__all__ = ["provenance", "repo_root", "portable_command", "portable_path", "scrub_paths"]

# Machine folders a committed result must not name (tests/unit/test_portable_paths.py checks the
# committed files for these).
MACHINE_ROOTS = ("work", "root", "home", "tmp", "scratch")
_ABS = re.compile(r"(?:(?<![\w.~-])|(?<=\\[ntr]))/(?:" + "|".join(MACHINE_ROOTS) + r")(?:/[^\s'\"(),:;\]\[<>|`\\]*)?")

def _runtime_package() -> Path:
    import speculators_compat

    return Path(speculators_compat.__file__).resolve().parent


_PACKAGE = _runtime_package()  # .../src/speculators_compat: the runtime code that runs
_TESTBED = Path(__file__).resolve().parent  # .../testbed/speculators_compat_testbed


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


_CHECKOUT_DIRS = ("/src/speculators_compat", "/testbed/speculators_compat_testbed", "/benchmarks/", "/scripts/", "/tests/", "/compat_matrix.yaml")


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
    for top in (_PACKAGE.parent, _TESTBED.parent):
        try:
            rel = p.resolve().relative_to(top)
            break
        except (ValueError, OSError):
            continue
    else:
        return None
    if rel.suffix != ".py":
        return None
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__main__":
        parts = parts[:-1]
    return ".".join(parts)


def provenance(command: str | list[str] | None = None, root: Path | None = None) -> dict:
    """The provenance block (see the module docstring). ``command``: a string, an argv list, or
    None (this process's ``sys.argv``). ``root``: the checkout to describe (default: the one
    whose src/ holds this package)."""
    root = Path(root) if root is not None else repo_root()
    if isinstance(command, str):
        cmd = command
    else:
        cmd = portable_command(command, root)
    matrix = _matrix_path()
    out: dict = {
        "commit": None,
        "dirty": None,
        "src_tree": None,
        "testbed_tree": None,
        "matrix_sha256": hashlib.sha256(matrix.read_bytes()).hexdigest() if matrix else None,
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": cmd,
        "host": socket.gethostname(),
        "machine": machine(),
    }
    if root is None:
        out["reason"] = f"speculators_compat is not imported from a source checkout ({_PACKAGE.name} is installed)"
        return out
    if not (root / ".git").exists() or _stamped_after_git(root):
        return _from_files(root, out, matrix)
    try:
        commit = _git(root, "rev-parse", "HEAD").strip()
        src_tree = _git(root, "rev-parse", f"{commit}:src").strip()
        testbed_tree = _testbed_tree(root, commit)
        paths = ["src"] + [p for p in ("testbed", "compat_matrix.yaml") if (root / p).exists()]
        # tracked changes (staged or not) and untracked, non-ignored files under src/ and testbed/
        changed = [ln[3:] for ln in _git(root, "status", "--porcelain", "--untracked-files=all", "--", *paths).splitlines() if ln.strip()]
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        out["reason"] = f"no git information for the checkout: {type(exc).__name__}: {exc}"
        return out
    own = root / "compat_matrix.yaml"
    if matrix is not None and own.is_file() and matrix.read_bytes() != own.read_bytes():
        changed.append(f"matrix in use is not the checkout's compat_matrix.yaml ({matrix.name})")
    out.update(commit=commit, dirty=bool(changed), src_tree=src_tree, testbed_tree=testbed_tree)
    if changed:
        out["dirty_files"] = changed[:20]
    return out


def _stamped_after_git(root: Path) -> bool:
    """True where ``.checkout.json`` names a commit this copy's .git does not hold: a copy whose
    .git is older than its work tree (the device tool's), where git would describe the old commit."""
    import json

    try:
        commit = str(json.loads((root / STAMP).read_text())["commit"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    try:  # a git that cannot read this .git (missing, refused) says so through the git path
        _git(root, "rev-parse", "HEAD")
    except (OSError, RuntimeError, subprocess.SubprocessError):
        return False
    try:
        _git(root, "cat-file", "-e", f"{commit}^{{commit}}")
    except (OSError, RuntimeError, subprocess.SubprocessError):
        return True
    return False


def _testbed_tree(root: Path, commit: str) -> str | None:
    """``git rev-parse <commit>:testbed``; None where the commit has no testbed/ (its files, if
    any, then show as untracked: dirty)."""
    try:
        return _git(root, "rev-parse", f"{commit}:testbed").strip()
    except RuntimeError:
        return None


def machine() -> dict:
    """The CPU (model name, the flags that pick vLLM's CPU kernels) and the GPU, if torch has one
    initialised in this process (nothing is imported or initialised for this)."""
    from speculators_compat.patches.cpu_attention import cpu_flags

    model = None
    try:
        with open("/proc/cpuinfo") as fh:
            model = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), None)
    except OSError:
        pass
    out: dict = {"cpu": model, "cpu_flags": cpu_flags(), "cpus": os.cpu_count()}
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            out["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - the provenance never fails on this
        pass
    return out


STAMP = ".checkout.json"  # ignored by git (.gitignore); carried to machines without .git


def _blob_id(data: bytes) -> bytes:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).digest()


_IGNORED_PARTS = ("__pycache__",)
_IGNORED_SUFFIXES = (".pyc", ".pyo")


def tree_id(folder: Path) -> str:
    """The git tree hash of ``folder``'s files, computed from the files (what ``git rev-parse
    <commit>:<folder>`` gives for a clean checkout); ``__pycache__``/``*.pyc`` are left out, as
    .gitignore does, and empty folders (git keeps none)."""

    def tree(d: Path) -> bytes | None:
        entries = []
        for child in d.iterdir():
            if child.name in _IGNORED_PARTS or child.name.endswith(_IGNORED_SUFFIXES) or child.name.endswith(".egg-info"):
                continue
            if child.is_symlink():
                entries.append((child.name, b"120000", _blob_id(os.readlink(child).encode())))
            elif child.is_dir():
                sub = tree(child)
                if sub is not None:
                    entries.append((child.name + "/", b"40000", sub))
            elif child.is_file():
                # git records the owner's execute bit (not whether THIS user may execute: root may)
                mode = b"100755" if child.stat().st_mode & stat.S_IXUSR else b"100644"
                entries.append((child.name, mode, _blob_id(child.read_bytes())))
        if not entries:
            return None
        entries.sort(key=lambda e: e[0].encode())  # git orders a folder as its name + "/"
        body = b"".join(m + b" " + n.rstrip("/").encode() + b"\0" + h for n, m, h in entries)
        return hashlib.sha1(b"tree %d\0" % len(body) + body).digest()

    got = tree(folder)
    return got.hex() if got is not None else ""


def _from_files(root: Path, out: dict, matrix: Path | None) -> dict:
    import json

    stamp = root / STAMP
    if not stamp.is_file():
        out["reason"] = f"no .git and no {STAMP} in the checkout copy: cannot bind the result to a commit"
        return out
    try:
        recorded = json.loads(stamp.read_text())
        commit, want = str(recorded["commit"]), str(recorded["src_tree"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        out["reason"] = f"{STAMP} unreadable: {type(exc).__name__}: {exc}"
        return out
    have = tree_id(root / "src")
    changed = [] if have == want else [f"src/ tree from files {have[:12]} != {want[:12]} recorded for {commit[:12]}"]
    bed = tree_id(root / "testbed") if (root / "testbed").is_dir() else None
    if recorded.get("testbed_tree") and bed != recorded["testbed_tree"]:
        changed.append(f"testbed/ tree from files {str(bed)[:12]} != {recorded['testbed_tree'][:12]} recorded for {commit[:12]}")
    own = root / "compat_matrix.yaml"
    if recorded.get("matrix_sha256") and own.is_file() and hashlib.sha256(own.read_bytes()).hexdigest() != recorded["matrix_sha256"]:
        changed.append("compat_matrix.yaml differs from the stamped commit's")
    if matrix is not None and own.is_file() and matrix.read_bytes() != own.read_bytes():
        changed.append(f"matrix in use is not the checkout's compat_matrix.yaml ({matrix.name})")
    out.update(commit=commit, dirty=bool(changed), src_tree=have, testbed_tree=bed, src_tree_from="files")
    if changed:
        out["dirty_files"] = changed
    return out


def stamp(root: Path | None = None) -> Path:
    """Write ``.checkout.json`` (HEAD's commit, its src tree and matrix hash) for a copy of the
    checkout that travels without .git. Refuses a dirty src/: the stamp would not describe it."""
    import json

    root = Path(root) if root is not None else repo_root()
    if root is None:
        raise RuntimeError("not a source checkout")
    if (root / ".git").exists():  # a stamp describes git's HEAD, never an earlier stamp
        (root / STAMP).unlink(missing_ok=True)
    info = provenance("stamp", root=root)
    if info.get("dirty") or not info.get("commit"):
        raise RuntimeError(f"refusing to stamp: {info.get('dirty_files') or info.get('reason')}")
    own = root / "compat_matrix.yaml"
    data = {"commit": info["commit"], "src_tree": info["src_tree"], "testbed_tree": info.get("testbed_tree"),
            "matrix_sha256": hashlib.sha256(own.read_bytes()).hexdigest() if own.is_file() else None}
    path = root / STAMP
    path.write_text(json.dumps(data) + "\n")
    return path


if __name__ == "__main__":  # python -m speculators_compat_testbed.provenance [--stamp]
    import json

    if "--stamp" in sys.argv[1:]:
        print(stamp())
    else:
        print(json.dumps(provenance(), indent=2))
