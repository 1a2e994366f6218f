#!/usr/bin/env python3
"""A vLLM worker that cannot start: what the caller's exception says, with the shim and without.

Builds the tiny Llama, copies it with a corrupt safetensors header, and starts speculators'
generator on it in a fresh process (the machine's own vLLM: CPU or GPU), once with the shim's
worker-start-cause patches and once with both left out (the control). One JSON with provenance:
per start, the exception's type and message, and whether the message names the cause.

    python scripts/worker_start_check.py --out benchmarks/results/gpu/worker_start_h200.json [--method spawn] [--tp 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

START = r"""
import json, sys
import speculators_compat
from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator
if __name__ == "__main__":
    try:
        VllmHiddenStatesGenerator(sys.argv[1], layer_ids=[1, 2], tensor_parallel_size=int(sys.argv[2]),
                                  gpu_memory_utilization=0.15)
        out = None
    except BaseException as exc:
        out = {"type": f"{type(exc).__module__}.{type(exc).__qualname__}", "message": str(exc)}
    print("RESULT " + json.dumps(out), flush=True)
"""
OFF = "-worker-start-cause-record,-worker-start-cause-raise"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--method", default="spawn", choices=("spawn", "fork"))
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()
    import speculators_compat  # noqa: F401
    from speculators_compat_testbed import build_tiny_model
    from speculators_compat_testbed.provenance import portable_command, provenance, scrub_paths

    work = Path(tempfile.mkdtemp(prefix="worker-start-"))
    model = work / "llama-corrupt"
    shutil.copytree(build_tiny_model("llama"), model)
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[:8] = (2**62).to_bytes(8, "little")  # a header length no file has
    weights.write_bytes(bytes(data))
    (work / "start.py").write_text(START)
    starts = {}
    for name, patches in (("shim", None), ("control_patches_left_out", OFF)):
        env = dict(os.environ, VLLM_WORKER_MULTIPROC_METHOD=args.method)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if patches:
            env["SPECULATORS_COMPAT_PATCHES"] = patches
        proc = subprocess.run([sys.executable, str(work / "start.py"), str(model), str(args.tp)], capture_output=True,
                              text=True, env=env, timeout=600)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        err = json.loads(line[7:]) if line else {"type": None, "message": f"no result, rc {proc.returncode}: "
                                                                          f"{proc.stderr[-500:]}"}
        msg = (err or {}).get("message") or ""
        starts[name] = {"error": err, "names_cause": "Causes recorded by the workers" in msg and "SafetensorError" in msg}
        print(f"{name}: {str(err)[:300]}", file=sys.stderr)
    shutil.rmtree(work, ignore_errors=True)
    out = {"provenance": provenance(portable_command(sys.argv)), "method": args.method, "tensor_parallel_size": args.tp,
           "starts": starts,
           "passed": starts["shim"]["names_cause"] and not starts["control_patches_left_out"]["names_cause"]
           and (starts["shim"]["error"] or {}).get("type") == (starts["control_patches_left_out"]["error"] or {}).get("type")}
    from speculators_compat_testbed.provenance import machine

    out["provenance"]["machine"] = machine()
    Path(args.out).write_text(json.dumps(scrub_paths(out), indent=2) + "\n")
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
