#!/usr/bin/env python3
"""The per-architecture cells made by HEAD's src tree, as a markdown table (benchmarks/results/arch).

    python3 scripts/arch_summary.py            # prints the table; cells of other trees are listed as stale

A cell counts only when its provenance is clean and names HEAD's src tree (as scripts/update_tested.py
rules for the tested table)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCH = ROOT / "benchmarks" / "results" / "arch"


def main() -> int:
    head = subprocess.run(["git", "rev-parse", "HEAD:src"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    rows, stale = [], []
    for f in sorted(ARCH.glob("spec-*.json")):
        d = json.loads(f.read_text())
        p = d.get("provenance") or {}
        if p.get("src_tree") != head or p.get("dirty") is not False:
            stale.append(f.name)
            continue
        v = d.get("versions", {})
        cases = {k: c for k, c in (d.get("cases") or {}).items() if isinstance(c, dict) and c.get("max_error") is not None}
        err = max((c["max_error"] for c in cases.values()), default=None)
        worst = max(((c.get("worst_row") or {}).get("error", 0) for c in cases.values()), default=None)
        repeat = (d.get("cases") or {}).get("repeat", {}).get("identical")
        settled = (d.get("settled") or {}).get("settled")
        verdict = ("error: " + d["error"]["type"] if d.get("error") else "pass" if d.get("passed")
                   else "settled: bit-identical to vLLM's own forward" if settled else "**FAIL**")
        rows.append(f"| {v.get('speculators')} | {v.get('vllm')} | {d.get('arch')}{' (' + f.stem.split('_' + d.get('arch', ''), 1)[-1].strip('_') + ')' if f.stem.split('_' + d.get('arch', ''), 1)[-1] else ''} "
                    f"| {d.get('dtype')} | {d.get('reference')} | {verdict} | "
                    f"{'%.2e' % err if err is not None else '—'} | {'%.2e' % worst if worst is not None else '—'} | {repeat} | [{f.name}]({f.name}) |")
    print(f"Cells at src tree `{head[:7]}` (clean), row-exact (bounds in `testbed/speculators_compat_testbed/reference.py`):\n")
    print("| speculators | vLLM | arch | dtype | reference | verdict | max rel. err | worst row | repeat identical | file |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    print(f"\nStale (earlier code or no provenance, not claims): {len(stale)} files — " + ", ".join(stale))
    return 0


if __name__ == "__main__":
    sys.exit(main())
