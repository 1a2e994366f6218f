#!/usr/bin/env python3
"""Re-run the per-architecture cells of one (speculators, vLLM) pair at HEAD (benchmarks/results/arch).

Each cell file ``spec-S_vllm-V_NAME.json`` is run again with the runner arguments it records,
in the bed env ``.bed/envs/spec-S_vllm-V`` with this checkout's src/ and testbed/ first on
PYTHONPATH, and rewritten in place (provenance from the runner); then the summary table.

    python3 scripts/arch_cells.py --pair 0.4.0.1:0.32.0 [--only qwen3_5,kimi_k25] [--dry-run]

A result counts only from a clean tree (``scripts/arch_summary.py`` rules), so a dirty src/ or
testbed/ is refused unless ``--allow-dirty``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCH = ROOT / "benchmarks" / "results" / "arch"
RUNNER = "speculators_compat_testbed.e2e_runner"
VARIANTS = ("deepseek_v3_llama4scaling", "kimi_k25_int4_vllmref")


def runner_args(command: str) -> list[str]:
    """The recorded command's runner arguments, without the module and ``--out``."""
    words = shlex.split(command)
    module = next((i for i, w in enumerate(words) if w.endswith("e2e_runner")), None)
    if module is None:
        raise ValueError(f"expected an e2e_runner command; found {command!r}")
    args, out = words[module + 1:], []
    skip = False
    for w in args:
        if skip:
            skip = False
        elif w == "--out":
            skip = True
        else:
            out.append(w)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", required=True, help="SPEC:VLLM, e.g. 0.4.0.1:0.32.0")
    ap.add_argument("--only", default=None, help="comma-separated cell names (the part after the pair); default: "
                    "one cell per architecture plus " + ", ".join(VARIANTS) + " (diagnostic cells only by name: "
                    "some need settings their file does not record)")
    ap.add_argument("--timeout", type=float, default=3000)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--allow-dirty", action="store_true")
    args = ap.parse_args()
    spec, vllm = args.pair.split(":")
    prefix = f"spec-{spec}_vllm-{vllm}_"
    python = ROOT / ".bed" / "envs" / f"spec-{spec}_vllm-{vllm}" / "bin" / "python"
    if not python.is_file():
        print(f"no bed env for {args.pair}: expected {python.relative_to(ROOT)} (scripts/bed.py build)", file=sys.stderr)
        return 2
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "src", "testbed", "compat_matrix.yaml"],
                           cwd=ROOT, capture_output=True, text=True).stdout.strip()
    if dirty and not args.allow_dirty and not args.dry_run:
        print(f"src/testbed not clean (results would not count):\n{dirty}", file=sys.stderr)
        return 2
    cells = sorted(p for p in ARCH.glob(prefix + "*.json"))
    sys.path.insert(0, str(ROOT / "testbed"))
    from speculators_compat_testbed.tiny.configs import ARCHITECTURES

    keep = set(args.only.split(",")) if args.only else set(ARCHITECTURES) | set(VARIANTS)
    cells = [p for p in cells if p.stem[len(prefix):] in keep]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "testbed")]))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    failed = 0
    for cell in cells:
        recorded = json.loads(cell.read_text())
        command = recorded.get("command") or (recorded.get("provenance") or {}).get("command") or ""
        try:
            extra = runner_args(command)
        except ValueError as exc:
            print(f"{cell.stem[len(prefix):]}: skipped ({exc})", flush=True)
            failed += 1
            continue
        rel = cell.relative_to(ROOT)
        cmd = [str(python), "-m", RUNNER, *extra, "--out", str(rel)]
        print(f"{cell.stem[len(prefix):]}: {' '.join(extra)}", flush=True)
        if args.dry_run:
            continue
        t = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
        new = json.loads(cell.read_text()) if cell.is_file() else {}
        ok = proc.returncode == 0 and bool(new.get("passed"))
        failed += not ok
        print(f"  {'pass' if ok else 'FAIL'} exit {proc.returncode} in {time.perf_counter() - t:.0f} s", flush=True)
        if not ok:
            print("  " + "\n  ".join((proc.stderr or proc.stdout).strip().splitlines()[-8:]), flush=True)
    if not args.dry_run:
        subprocess.run([sys.executable, str(ROOT / "scripts" / "arch_summary.py")], cwd=ROOT)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
