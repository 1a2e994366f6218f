"""README's "In your own code" block, run as written (one engine start) on the installed vLLM.

Also the exit: a generator alive at interpreter exit used to print speculators' ``__del__``
``AttributeError`` (patch ``generator-del-partial``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

pytest.importorskip("vllm")
pytest.importorskip("speculators")

README = Path(__file__).resolve().parents[2] / "README.md"
RUNTIME = {"speculators_compat", "speculators", "vllm", "torch", "sys", "os"}  # what a user's env has


def readme_snippet() -> str:
    text = README.read_text()
    section = text[text.index("## Use it in your own code"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README's 'In your own code' section has no python block"
    return match.group(1)


def test_readme_snippet_needs_only_the_runtime_wheel():
    """The test bed (speculators_compat_testbed) ships in another distribution: not for users."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(readme_snippet())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
    assert not any(n.startswith("speculators_compat_testbed") for n in names), names
    assert {n.split(".")[0] for n in names} <= RUNTIME, names


def test_readme_snippet_runs_as_written(tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(readme_snippet())
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from speculators_compat_testbed import build_tiny_model

    model = build_tiny_model("llama")  # the snippet takes the user's model path
    proc = subprocess.run([sys.executable, str(script), str(model)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "[(10, 128), (10, 128), (10, 128)]" in proc.stdout, proc.stdout[-2000:]
    assert "Exception ignored in" not in proc.stderr, proc.stderr[-3000:]
