#!/usr/bin/env python3
"""Re-run every CPU e2e cell at HEAD, then regenerate the tested table (``make sweep``).

Cells: every (speculators, vLLM) pair of ``noxfile.PAIRS`` x ``--archs`` (default llama,qwen3),
each through ``speculators_compat_testbed.e2e_runner`` in that pair's test-bed env with this
checkout's ``src/`` first on PYTHONPATH, written to
``benchmarks/results/e2e/spec-S_vllm-V_ARCH.json``; then ``scripts/update_tested.py``.

    python3 scripts/sweep.py [--jobs N] [--pairs 0.4.0.1:0.32.0,...] [--archs llama,qwen3]
                             [--unpatched] [--dry-run] [--allow-dirty]

``--jobs``: cells run at once (default 1; each CPU engine wants ~2 cores and a few GB). A
result counts only when produced from a clean tree (provenance ``dirty: false``), so the sweep
refuses to start on a dirty src/ or compat_matrix.yaml unless ``--allow-dirty``.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "e2e"
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(1, str(ROOT / "testbed"))


def nox_pairs() -> list[tuple[str, str]]:
    """``PAIRS`` of noxfile.py, evaluated from its SPECULATORS / VLLM / PAIRS assignments (nox
    itself need not be installed)."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    ns: dict = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and node.targets[0].id in ("SPECULATORS", "VLLM", "PAIRS"):
            exec(compile(ast.Module([node], []), "noxfile.py", "exec"), ns)  # noqa: S102 - our own file
            if node.targets[0].id == "PAIRS":
                break
    return [tuple(p) for p in ns["PAIRS"]]


def bed_python(spec: str, vllm: str) -> str:
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bed.py"), "python", "--speculators", spec,
                        "--vllm", vllm], stdout=subprocess.PIPE, text=True)
    if r.returncode != 0 or not r.stdout.strip():
        raise RuntimeError(f"test bed failed for speculators {spec}, vLLM {vllm} (see scripts/bed.py output above)")
    return r.stdout.strip().splitlines()[-1]


def out_path(spec: str, vllm: str, arch: str, unpatched: bool) -> Path:
    return OUT / f"spec-{spec}_vllm-{vllm}_{arch}{'_unpatched' if unpatched else ''}.json"


def run_cell(py: str, spec: str, vllm: str, arch: str, unpatched: bool, timeout: int) -> dict:
    dest = out_path(spec, vllm, arch, unpatched)
    cmd = [py, "-m", "speculators_compat_testbed.e2e_runner", "--arch", arch, "--out", str(dest)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "testbed")]), "VLLM_CPU_KVCACHE_SPACE":
           os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    if unpatched:
        cmd.append("--unpatched")
        env["SPECULATORS_COMPAT_DISABLE"] = "1"
    t0 = time.time()
    before = dest.stat().st_mtime_ns if dest.exists() else None
    with tempfile.TemporaryDirectory(prefix="sweep-cell-") as cwd:  # vLLM writes into its cwd
        try:
            r = subprocess.run(["nice", "-n", "5", *cmd], cwd=cwd, env=env, capture_output=True, text=True,
                               timeout=timeout)
            code, tail = r.returncode, (r.stdout + r.stderr)[-1500:]
        except subprocess.TimeoutExpired:
            code, tail = None, f"timed out after {timeout}s"
    cell = {"cell": dest.name, "seconds": round(time.time() - t0), "exit": code}
    if dest.exists() and dest.stat().st_mtime_ns != before:  # the runner writes it whole (os.replace)
        data = json.loads(dest.read_text())
        cell["passed"] = data.get("passed")
        cell["error"] = (data.get("error") or {}).get("type")
    else:
        cell["passed"] = None
        cell["error"] = "no result written: " + " ".join(tail.split())[-300:]
    return cell


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", "-j", type=int, default=int(os.environ.get("SWEEP_JOBS", "1")))
    ap.add_argument("--pairs", default=os.environ.get("SWEEP_PAIRS", ""),
                    help="comma-separated S:V (default: noxfile.PAIRS)")
    ap.add_argument("--archs", default=os.environ.get("SWEEP_ARCHS", "llama,qwen3"))
    ap.add_argument("--unpatched", action="store_true", help="also the unpatched llama cell of each pair")
    ap.add_argument("--timeout", type=int, default=1500, help="seconds per cell")
    ap.add_argument("--dry-run", action="store_true", help="list the cells and exit")
    ap.add_argument("--allow-dirty", action="store_true", help="run although src/ or the matrix differ from HEAD "
                    "(the results will not count)")
    args = ap.parse_args(argv)

    pairs = [tuple(p.split(":")) for p in args.pairs.split(",") if p] if args.pairs else nox_pairs()
    archs = [a for a in args.archs.split(",") if a]
    cells = [(s, v, a, False) for s, v in pairs for a in archs]
    if args.unpatched:
        cells += [(s, v, "llama", True) for s, v in pairs]
    if args.dry_run:
        for s, v, a, u in cells:
            print(out_path(s, v, a, u).relative_to(ROOT))
        return 0

    from speculators_compat_testbed.provenance import provenance

    prov = provenance("scripts/sweep.py")
    if prov.get("dirty") is not False and not args.allow_dirty:
        print(f"sweep: the tree is not clean ({prov.get('dirty_files') or prov.get('reason')}); results from it "
              "would not count. Commit first, or pass --allow-dirty.", file=sys.stderr)
        return 2
    print(f"sweep: {len(cells)} cells at {str(prov.get('commit'))[:10]} (src tree {str(prov.get('src_tree'))[:10]}),"
          f" {args.jobs} at a time", file=sys.stderr)
    pys = {}
    for s, v in pairs:  # build/reuse the envs one at a time (bed.py serialises per env anyway)
        try:
            pys[(s, v)] = bed_python(s, v)
        except RuntimeError as exc:
            print(f"sweep: {exc}", file=sys.stderr)
    results, failed = [], 0
    with cf.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futs = {pool.submit(run_cell, pys[(s, v)], s, v, a, u, args.timeout): (s, v, a, u)
                for s, v, a, u in cells if (s, v) in pys}
        for fut in cf.as_completed(futs):
            cell = fut.result()
            results.append(cell)
            unpatched = futs[fut][3]
            # an unpatched control is as expected when it does not pass (a wrong result or an error)
            bad = cell["passed"] is True if unpatched else cell["passed"] is not True
            failed += bad
            print(f"sweep: [{len(results)}/{len(futs)}] {cell['cell']}: "
                  f"{'passed' if cell['passed'] else 'FAILED'} {cell['error'] or ''} ({cell['seconds']}s)",
                  file=sys.stderr)
    failed += len(cells) - len(futs)  # envs that could not be built
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "update_tested.py")])
    print(f"sweep: {len(results)} cells run, {failed} not as expected; tested table regenerated", file=sys.stderr)
    return 1 if failed or r.returncode else 0


if __name__ == "__main__":
    raise SystemExit(main())
