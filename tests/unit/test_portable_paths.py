"""Committed files name no machine paths: results and docs must read the same on any checkout.

A committed text file (``git ls-files``) fails when it holds an absolute path into /work, /root,
/home, /tmp or /scratch (a checkout, a home, a scratch folder: the root followed by a name). The one allowed form is a shell
default such as ``${TMPDIR:-/tmp}`` (a fallback at run time, not a recorded path).
``scripts/scrub_paths.py`` rewrites such paths in result files (on this src tree not yet those after
an ANSI colour code or the ``\\r \\f \\uXXXX`` escapes, which this test also finds: fix those by hand).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
ROOTS = ("work", "root", "home", "tmp", "scratch")
# an absolute path starts a token: line start, whitespace, a quote, =, (, :, [, {, <, >, a comma,
# an escape inside a JSON string ("...\\n" then the path: \\n \\t \\r \\f \\v \\0 \\uXXXX), or the end of
# an ANSI colour code (ESC[0m, ESC[31m, ESC[m, raw or escaped)
ABS_PATH = re.compile(r"(?:^|(?<=[\s\"'`=(:\[{<>,\0])|(?<=\\[ntrfv0])|(?<=\\u[0-9a-fA-F]{4})|(?<=\dm)|(?<=\[m))/(?:"
                      + "|".join(ROOTS) + r")(?=/[^\s/])", re.MULTILINE)
SHELL_DEFAULT = re.compile(r"\$\{\w+:-/(?:" + "|".join(ROOTS) + r")\b")
SKIP_SUFFIXES = {".png", ".jpg", ".pt", ".xz", ".gz", ".whl", ".so"}


def committed_files(root: Path = ROOT) -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
        return [root / p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file of the tree
        skip = {".git", ".venv", ".bed", ".nox", "__pycache__"}
        return [p for p in root.rglob("*") if p.is_file() and not skip & set(p.relative_to(root).parts)]


def machine_paths(text: str) -> list[str]:
    """The absolute machine paths in ``text`` (the line of each hit, shortened)."""
    hits = []
    for m in ABS_PATH.finditer(SHELL_DEFAULT.sub("${DEFAULT}", text)):
        line = text.count("\n", 0, m.start()) + 1
        content = text.splitlines()[line - 1] if text.splitlines() else text
        hits.append(f"line {line}: {content.strip()[:120]}")
    return hits


def offending(files) -> dict[str, list[str]]:
    bad = {}
    for p in files:
        if p.suffix in SKIP_SUFFIXES or not p.is_file():
            continue
        try:
            text = p.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        hits = machine_paths(text)
        if hits:
            bad[str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)] = hits[:3]
    return bad


def test_no_committed_file_holds_a_machine_path():
    bad = offending(committed_files())
    assert not bad, "absolute machine paths in committed files (scripts/scrub_paths.py rewrites results):\n" + "\n".join(
        f"  {f}: {h}" for f, hs in sorted(bad.items()) for h in hs
    )


# planted paths are assembled at run time, so this committed file holds none itself
_S = "/"


@pytest.mark.parametrize(
    "planted",
    [
        '{"model_dir": "' + _S + 'root/.cache/speculators_compat/models/llama-abc"}',
        "cd " + _S + "tmp/spec-compat && python x.py",
        "PY=" + _S + "work/main/.bed/envs/spec-0.4.0.1_vllm-0.32.0/bin/python",
        '  File "' + _S + 'home/me/src/x.py", line 3',
        "--out=" + _S + "scratch/out.json",
        _S + "tmp/x",
        '"traceback": "line one\\r' + _S + 'work/main/src/x.py"',
        '"log": "\\u001b[0m' + _S + 'root/.cache/x"',
        "\x1b[31m" + _S + "home/me/x.log\x1b[0m",
        '"a": "page\\f' + _S + 'scratch/x"',
        '"a": "nul\\u0000' + _S + 'tmp/x"',
    ],
)
def test_planted_path_is_found(tmp_path, planted):
    f = tmp_path / "planted.json"
    f.write_text("ok\n" + planted + "\n")
    assert machine_paths(f.read_text()), planted
    assert offending([f])


@pytest.mark.parametrize(
    "clean",
    [
        "benchmarks/results/e2e/x.json",
        "WORK=${TMPDIR:-" + _S + "tmp}/gpu-bundle-work",
        "<env>/site-packages/vllm/x.py and .bed/envs/spec-0.3.0_vllm-0.16.0",
        "https://example.org/home/page and a/work/b",
        "/usr/lib/python3 and /proc/self",
        "folder names alone: /work, /root, /home, /tmp or /scratch; cd /tmp && true",
    ],
)
def test_portable_text_passes(clean):
    assert not machine_paths(clean), clean
