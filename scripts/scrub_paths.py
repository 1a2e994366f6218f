#!/usr/bin/env python3
"""Rewrite absolute machine paths (/work, /root, /home, /tmp, /scratch) in committed result
files to portable names, in place: inside a checkout -> relative (``src/...``, ``benchmarks/...``),
in an env -> ``<env>/site-packages/...``, a test bed -> ``.bed/...``, else ``<tmp>/name``.

    python3 scripts/scrub_paths.py benchmarks/results        # every text file under it (git ls-files)

JSON files are checked to still parse. tests/unit/test_portable_paths.py fails while any
committed text file holds such a path.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(1, str(ROOT / "testbed"))

from speculators_compat_testbed.provenance import scrub_paths  # noqa: E402


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: scrub_paths.py PATH...", file=sys.stderr)
        return 2
    files = subprocess.run(["git", "ls-files", "--", *argv], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    changed = 0
    for rel in files:
        p = ROOT / rel
        try:
            text = p.read_text()
        except (UnicodeDecodeError, OSError):
            continue  # binary
        new = scrub_paths(text, root=ROOT)
        if new == text:
            continue
        if p.suffix == ".json":
            json.loads(new)  # still valid
        p.write_text(new)
        changed += 1
        print(f"scrubbed {rel}")
    print(f"{changed} of {len(files)} files rewritten")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
