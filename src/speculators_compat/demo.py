"""``speculators-compat demo``: a tiny model through speculators' real generator, against HF.

Needs an environment with vLLM, speculators, torch and transformers (the test bed builds one:
``make demo``). Prints which patches applied (here and in the vLLM worker), the captured
shapes, per-layer agreement with HF transformers and tokens/s; exits 1 with the reason when
anything disagrees.
"""

from __future__ import annotations

import json
import sys
import time


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_demo(args) -> int:
    import importlib.util

    try:
        from speculators_compat_testbed import e2e_runner
    except ImportError:
        print(
            "speculators-compat demo: the test bed (speculators_compat_testbed) is not installed: it ships as "
            "speculators-compat-testing (testbed/ in the repository); from a checkout, `make demo` builds it",
            file=sys.stderr,
        )
        return 3

    missing = [m for m in ("vllm", "speculators", "torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        print(
            f"speculators-compat demo: {', '.join(missing)} not installed here; run `make demo` (builds the test bed)",
            file=sys.stderr,
        )
        return 3
    argv = ["--arch", args.arch] + (["--layers", args.layers] if args.layers else [])
    ns = e2e_runner.build_parser().parse_args(argv)  # the runner's own defaults
    r = e2e_runner.run(ns, progress=_say)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2, default=str)
    v = r["versions"]
    print(f"\nspeculators {v['speculators']} · vLLM {v['vllm']} · transformers {v['transformers']} · torch {v['torch']} · {r['platform']}")
    if "error" in r:
        print(f"FAILED: {r['error']['type']}: {r['error']['message']}\n{r['error']['traceback']}", file=sys.stderr)
        return 1
    print("patches applied in this process:", ", ".join(p["id"] for p in r["patches"] if p["status"] == "applied"))
    worker = r.get("worker", {})
    if "patches" in worker:
        print(f"patches applied in the vLLM worker (pid {worker['pid']}, {worker['runner_class']}):",
              ", ".join(p["id"] for p in worker["patches"] if p["status"] == "applied"))
    print(f"captured layers {r['layer_ids']} in {r['dtype']}; engine start {r['init_s']:.1f}s\n")
    print(f"{'batch':<10} {'seqs':>4} {'tokens':>7} {'tok/s':>8} {'max rel err':>12} {'tolerance':>10}  result")
    for name in ("mixed", "chunked", "truncated"):
        c = r["cases"][name]
        print(f"{name:<10} {len(c['lengths_in']):>4} {c['tokens']:>7} {c['tokens_per_s']:>8.0f} "
              f"{c['max_error']:>12.3e} {c['tolerance']:>10.1e}  {'ok' if c['passed'] else 'FAIL'}")
    print(f"repeat     identical to the first call: {r['cases']['repeat']['identical']}")
    first = r["cases"]["mixed"]
    print(f"shapes: sequence i -> {len(r['layer_ids'])} tensors of [len_i, hidden]; lengths {first['lengths_out']}")
    if not r["passed"]:
        for name in ("mixed", "chunked", "truncated"):
            if not r["cases"][name]["passed"]:
                print(f"\n{name}: {r['cases'][name]['summary']}", file=sys.stderr)
        print("\nDEMO FAILED: captured hidden states disagree with HF (see above)", file=sys.stderr)
        return 1
    print("\nDEMO PASSED: speculators' generator under speculators-compat agrees with HF transformers")
    return 0
