"""Time to the first batch: vLLM's spawned workers vs workers forked from a preloaded forkserver.

A prototype measurement for faster retries (no src change): each side runs in a fresh process
per repetition, sides alternating, one warm-up run of each apart. ``spawn`` is what the generator
does today (each worker a fresh interpreter that imports torch, vLLM and speculators' worker
extension again); ``forkserver`` starts a forkserver at process start that imports those modules
while this process does its own imports, and hands vLLM that context, so a worker is a fork of an
interpreter that has them. Per run: process start -> imports done -> generator built -> first
``generate`` returned, and a hash of the first call's hidden states (both sides must agree).

    python benchmarks/worker_start.py --reps 3 --out worker_start_cpu_vllm-0.32.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# the shim first: speculators' import needs it on transformers 5 (a failed preload is silently skipped)
PRELOAD = ["speculators_compat", "torch", "vllm.v1.executor.multiproc_executor", "vllm.v1.worker.cpu_worker",
           "speculators.data_generation.custom_worker"]


def side(name: str, model: str, t_start: float) -> dict:
    marks = {"process": time.time() - t_start}
    ctx = None
    if name == "forkserver":
        import multiprocessing
        import multiprocessing.forkserver as forkserver

        multiprocessing.set_forkserver_preload(PRELOAD)
        ctx = multiprocessing.get_context("forkserver")
        forkserver.ensure_running()  # the server imports PRELOAD beside this process's imports
        marks["server_started"] = time.time() - t_start
    import hashlib

    import torch

    import speculators_compat  # noqa: F401  (the shim)
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

    marks["imports"] = time.time() - t_start
    if ctx is not None:
        import vllm.v1.executor.multiproc_executor as mpe

        original = mpe.get_mp_context

        def forkserver_context():
            original()  # vLLM's own checks, as always
            return ctx

        mpe.get_mp_context = forkserver_context  # a prototype: not how the shim would do it
    gen = VllmHiddenStatesGenerator(model, layer_ids=[1, 2, 3], max_model_len=512, tensor_parallel_size=1)
    marks["generator"] = time.time() - t_start
    ids = [[1 + (7 * i + 3 * j) % 900 for j in range(40 + 13 * i)] for i in range(4)]
    out = gen.generate(ids)
    marks["first_batch"] = time.time() - t_start
    h = hashlib.sha256()
    for r in out:
        for t in r["hidden_states"]:
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    del gen
    return {"side": name, "marks_s": marks, "states_sha256": h.hexdigest()}


def run_side(name: str, model: str, timeout: float) -> dict:
    env = dict(os.environ, WORKER_START_T0=repr(time.time()))
    proc = subprocess.run([sys.executable, __file__, "--side", name, "--model", model], env=env,
                          capture_output=True, text=True, timeout=timeout)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{\"side\"")]
    if proc.returncode or not line:
        return {"side": name, "error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-2000:]}
    return json.loads(line[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--side", choices=("spawn", "forkserver"))
    ap.add_argument("--model", default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.side:
        print(json.dumps(side(args.side, args.model, float(os.environ["WORKER_START_T0"]))), flush=True)
        return 0
    from speculators_compat_testbed.provenance import provenance, scrub_paths
    from speculators_compat_testbed.tiny_models import build_tiny_model

    model = args.model or str(build_tiny_model("llama", dtype="bfloat16"))
    warm = {s: run_side(s, model, args.timeout) for s in ("spawn", "forkserver")}
    reps = []
    for r in range(args.reps):
        order = ("spawn", "forkserver") if r % 2 == 0 else ("forkserver", "spawn")
        reps.append({s: run_side(s, model, args.timeout) for s in order})
        print(json.dumps({k: v.get("marks_s") or v.get("error") for k, v in reps[-1].items()}), flush=True)

    summary = {}
    for s in ("spawn", "forkserver"):
        ok = [rep[s]["marks_s"] for rep in reps if "marks_s" in rep[s]]
        summary[s] = {k: statistics.median([m[k] for m in ok]) for k in (ok[0] if ok else {})}
        summary[s]["runs"] = len(ok)
        summary[s]["generator_build_s"] = statistics.median([m["generator"] - m["imports"] for m in ok]) if ok else None
    hashes = {rep[s].get("states_sha256") for rep in reps for s in rep} | {w.get("states_sha256") for w in warm.values()}
    summary["same_states_every_run"] = len(hashes) == 1 and None not in hashes
    if summary["spawn"].get("first_batch") and summary["forkserver"].get("first_batch"):
        summary["first_batch_saved_s"] = summary["spawn"]["first_batch"] - summary["forkserver"]["first_batch"]
    result = {"provenance": provenance(), "command": "python benchmarks/worker_start.py " + " ".join(sys.argv[1:]),
              "preload": PRELOAD, "cpu_count": os.cpu_count(), "warmup": warm, "reps": reps, "summary": summary}
    text = json.dumps(scrub_paths(result), indent=2)
    print(json.dumps(summary, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
