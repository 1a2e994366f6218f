"""Rehearse every released config in tests/data/released_configs in this environment (the bed's
python: ``scripts/bed.py python ... scripts/rehearse_released.py``), each as a user would:
``speculators-compat check --model DIR --json``; then, per config, the rehearsal with the patch
its architecture needs left out (``SPECULATORS_COMPAT_PATCHES=-ID``), which must fail naming it.
Writes benchmarks/results/rehearsal/<label>.json with provenance and each model's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "data" / "released_configs"


def rehearse(slug: str, env_extra: dict | None = None, extra: list[str] | None = None) -> dict:
    cmd = [sys.executable, "-m", "speculators_compat", "check", "--model", str(CONFIGS / slug), "--json", *(extra or [])]
    env = dict(os.environ, **(env_extra or {}))
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    wall = time.perf_counter() - t
    try:
        out = json.loads(proc.stdout)
    except ValueError:
        out = {"verdict": "cannot", "stdout_tail": proc.stdout[-1500:], "stderr_tail": proc.stderr[-1500:]}
    out.pop("model", None)  # a machine path
    out.update(exit_code=proc.returncode, process_wall_s=round(wall, 1))
    if extra:
        out["check_args"] = extra
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True, help="result file name, e.g. cpu_spec-0.4.0.1_vllm-0.32.0")
    ap.add_argument("--only", default=None, help="comma-separated slugs")
    ap.add_argument("--out-dir", default=None, help="where the JSON goes (default benchmarks/results/rehearsal)")
    ap.add_argument("--controls", default=None,
                    help="JSON {slug: patch id} to leave out in a second run (must fail naming it)")
    ap.add_argument("--check-args", default="",
                    help="more arguments for every check --model, e.g. '--tensor-parallel-size 2' (recorded)")
    args = ap.parse_args()
    extra = args.check_args.split()
    from speculators_compat_testbed.provenance import provenance

    slugs = sorted(p.parent.name for p in CONFIGS.glob("*/config.json"))
    if args.only:
        slugs = [s for s in slugs if s in args.only.split(",")]
    out_path = Path(args.out_dir or ROOT / "benchmarks" / "results" / "rehearsal") / f"{args.label}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    prov = provenance()
    result = json.loads(out_path.read_text()) if out_path.exists() else {}
    if (result.get("provenance") or {}).get("src_tree") != prov.get("src_tree"):
        result = {}  # entries of another src tree are not extended: this file holds one tree's results
    result.setdefault("models", {})
    result.setdefault("controls", {})
    result["provenance"] = prov
    for slug in slugs:
        print(f"rehearsing {slug} ...", flush=True)
        r = rehearse(slug, extra=extra)
        r["commit"], r["src_tree"] = prov.get("commit"), prov.get("src_tree")
        result["models"][slug] = r
        print(f"  {r.get('verdict')} exit {r['exit_code']} in {r['process_wall_s']} s", flush=True)
        out_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    for slug, pid in (json.loads(args.controls) if args.controls else {}).items():
        print(f"control {slug} without {pid} ...", flush=True)
        r = rehearse(slug, {"SPECULATORS_COMPAT_PATCHES": f"-{pid}"}, extra)
        r["commit"], r["src_tree"] = prov.get("commit"), prov.get("src_tree")
        msg = json.dumps(r.get("failure") or {})
        r["left_out"] = pid
        r["failed_loudly"] = r.get("verdict") == "fail" and r["exit_code"] == 2
        result["controls"][f"{slug} -{pid}"] = r
        print(f"  {r.get('verdict')} exit {r['exit_code']}: {msg[:300]}", flush=True)
        out_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    try:  # the GPU, where there is one (provenance names only what this process initialised)
        import torch

        if torch.cuda.is_available():
            result["provenance"]["machine"]["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - no torch here: a CPU record
        pass
    from speculators_compat_testbed.provenance import scrub_paths

    out_path.write_text(json.dumps(scrub_paths(result), indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
