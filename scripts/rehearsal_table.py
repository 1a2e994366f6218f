"""Print the markdown table of the committed rehearsal results (benchmarks/results/rehearsal/*.json):
one row per released config, one column per result file (verdict, wall time, worst row error)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cell(r: dict | None) -> str:
    if not r:
        return "—"
    verdict = r.get("verdict", "?")
    wall = r.get("process_wall_s") or r.get("wall_s") or 0
    rows = [c.get("max_row_error") for n, c in (r.get("cases") or {}).items() if n != "repeat" and c.get("max_row_error") is not None]
    worst = f", worst row {max(rows):.1e}" if rows else ""
    if verdict == "cannot":
        tail = (r.get("stderr_tail") or "").strip().splitlines()
        why = tail[-1].split("cannot check: ", 1)[-1][:90] if tail else "?"
        return f"cannot: {why}"
    settled = r.get("settled") or {}
    if settled.get("settled"):  # HF disagreed; every row bit-identical to vLLM's own scheduled forward
        worst = f", vs HF worst row {max(rows):.1e}; own forward: every row bit-identical"
    elif settled.get("cases"):
        same = sum(c["identical"] for c in settled["cases"].values())
        worst += f"; own forward: {same}/{sum(c['rows'] for c in settled['cases'].values())} rows bit-identical"
    failure = (r.get("failure") or {}).get("message") or ""
    if verdict == "fail" and failure and not rows:  # failed before any row: the cause, as the worker gave it
        lines = failure.split("Causes recorded by the workers", 1)[-1].strip().splitlines()
        line = next((x for x in lines if re.search(r"\w+Error: ", x)), lines[0]).strip()
        causes = re.findall(r"\w+Error: ", line)  # the innermost of the chained "XError: YError: ..."
        worst = f": {line[line.rindex(causes[-1]):] if causes else line}"[:82]
    return f"**{verdict}** ({wall:.0f} s{worst})"


def main() -> int:
    files = sorted((ROOT / "benchmarks" / "results" / "rehearsal").glob("*.json"))
    data = {f.stem: json.loads(f.read_text()) for f in files}
    slugs = sorted({s for d in data.values() for s in d.get("models", {})})
    print("| config | " + " | ".join(data) + " |")
    print("| --- |" + " --- |" * len(data))
    for s in slugs:
        print(f"| {s} | " + " | ".join(cell(d.get("models", {}).get(s)) for d in data.values()) + " |")
    for name, d in data.items():
        for key, r in (d.get("controls") or {}).items():
            f = r.get("failure") or {}
            first = str(f.get("message", "")).splitlines()[0][:120] if f else ""
            print(f"\n- {name}: `{key}` -> {r.get('verdict')} (exit {r.get('exit_code')}): {first}", end="")
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
