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


def readme_snippet() -> str:
    text = README.read_text()
    section = text[text.index("### In your own code"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README's 'In your own code' section has no python block"
    return match.group(1)


def test_readme_snippet_runs_as_written(tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(readme_snippet())
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "[(10, 128), (10, 128), (10, 128)]" in proc.stdout, proc.stdout[-2000:]
    assert "Exception ignored in" not in proc.stderr, proc.stderr[-3000:]
