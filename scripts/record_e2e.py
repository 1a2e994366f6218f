"""Run one e2e cell (speculators_compat_testbed.e2e_runner) with a given Python and record the
result with provenance (commit, dirty, src tree, date, command, host), machine paths removed.

    python scripts/record_e2e.py --python PY --env-label LABEL --out OUT.json [--pythonpath-extra DIR
        --pythonpath-label LABEL]... [--env KEY=VALUE]... -- --arch llama [runner args]
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
    ap.add_argument("--pythonpath-extra", action="append", default=[])
    ap.add_argument("--pythonpath-label", action="append", default=[])
    ap.add_argument("--src", default=str(ROOT / "src"), help="the package under test (default: this checkout's src)")
    ap.add_argument("--src-label", default="<checkout>/src")
    ap.add_argument("--env", action="append", default=[])
    ap.add_argument("runner_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    runner = [a for a in args.runner_args if a != "--"]
    python = os.path.abspath(args.python)  # the runner starts in a temporary folder
    extra_env = dict(kv.split("=", 1) for kv in args.env)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECULATORS_COMPAT_")}
    env.update(extra_env)
    env["PYTHONPATH"] = os.pathsep.join(args.pythonpath_extra + [args.src, str(ROOT / "testbed")])
    with tempfile.TemporaryDirectory() as cwd:
        result = Path(cwd) / "result.json"
        started = time.perf_counter()
        proc = subprocess.run([python, "-m", "speculators_compat_testbed.e2e_runner", *runner, "--out", str(result)],
                              cwd=cwd, env=env, capture_output=True, text=True, timeout=3000)
        wall = time.perf_counter() - started
        cell = json.loads(result.read_text()) if result.is_file() else None
    labels = args.pythonpath_label + [f"x{i}" for i in range(len(args.pythonpath_extra) - len(args.pythonpath_label))]
    pypath = ":".join([f"<{lab}>" for lab in labels] + [args.src_label])
    envs = " ".join(f"{k}={v}" for k, v in extra_env.items())
    command = (f"cd $(mktemp -d) && PYTHONPATH={pypath} {envs} <{args.env_label}>/bin/python -m "
               f"speculators_compat_testbed.e2e_runner {' '.join(runner)} --out result.json")
    record = {
        "env": args.env_label,
        "exit_code": proc.returncode,
        "passed": bool(cell and cell.get("passed")),
        "wall_seconds": round(wall, 1),
        "command": command,
        "cell": scrub_paths(cell),
        "stderr_tail": scrub_paths("\n".join(proc.stderr.splitlines()[-15:])) if not (cell and cell.get("passed")) else "",
        "provenance": {**provenance(command), "host_detail": {"machine": platform.machine(), "cpus": os.cpu_count(), "gpu": False}},
    }
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"{args.out}: exit {proc.returncode}, passed {record['passed']}, {wall:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
