"""Import cost of speculators_compat: `python -c "import speculators_compat"` vs `python -c pass`.

    python benchmarks/import_cost.py [--runs 40] [--out benchmarks/results/import_cost.json]

Each sample is a fresh interpreter (wall time of the whole process, alternating the two
commands so that machine noise hits both); reports medians and the added cost. Also checks
that the import leaves torch, vllm, speculators and transformers unimported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


# as users run it: bytecode cached (some sandboxes set PYTHONDONTWRITEBYTECODE; drop it)
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def sample(code: str) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=ENV)
    return time.perf_counter() - t


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=40)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    bare, shim = [], []
    for _ in range(3):  # warm the page cache
        sample("pass"), sample("import speculators_compat")
    for _ in range(args.runs):
        bare.append(sample("pass"))
        shim.append(sample("import speculators_compat"))
    heavy = subprocess.run(
        [sys.executable, "-c", "import sys, speculators_compat; print(sorted(m for m in ('torch','vllm','speculators','transformers') if m in sys.modules))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testbed"))
    from speculators_compat_testbed.provenance import provenance

    res = {
        "provenance": provenance(),
        "machine_load_1min": os.getloadavg()[0],
        "python": sys.version.split()[0],
        "runs": args.runs,
        "bare_median_ms": statistics.median(bare) * 1e3,
        "shim_median_ms": statistics.median(shim) * 1e3,
        "added_median_ms": (statistics.median(shim) - statistics.median(bare)) * 1e3,
        "added_p25_p75_ms": [
            (statistics.quantiles(shim, n=4)[0] - statistics.quantiles(bare, n=4)[0]) * 1e3,
            (statistics.quantiles(shim, n=4)[2] - statistics.quantiles(bare, n=4)[2]) * 1e3,
        ],
        "heavy_modules_imported": json.loads(heavy.replace("'", '"')),
        "command": " ".join(sys.argv),
    }
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
