"""Extraction throughput: speculators' generator under the shim vs vLLM's own prefill.

One process, one model, the same prompts and batch shape; the sides are timed alternately over
several repetitions (median and spread), the order rotating every repetition (rep r starts with
side r mod n), so no side always runs first or right after another's allocations. The first,
warm-up call of each side is timed and reported apart (``warmup_s``), never in the medians.
``--capture-control`` adds a second generator on the same model capturing ONE layer
(``shim_1layer``): the ratio shim / shim_1layer is what capturing the requested layers costs,
separating it from what the generator's own driver saves or costs against ``LLM.generate``. Native = ``vllm.LLM.generate(prompts,
SamplingParams(max_tokens=1))`` with the engine settings the generator uses (eager, prefix
caching off, max_num_seqs 32, max_num_batched_tokens max(8192, max_model_len)).

    python benchmarks/throughput.py --hidden 512 --layers 6 --batch 16 --prompt-len 256 --reps 5 --out r.json

Writes a JSON with both sides' tokens/s per repetition, medians, spread and the ratio, plus
the peak host RSS of this process and its children and (GPU) peak device memory.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import resource
import statistics
import sys
import time


def _rss_mb() -> dict:
    self_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    child_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {"self_peak_mb": self_kb / 1024, "children_peak_mb": child_kb / 1024}


def _worker_rss_mb() -> list[float]:
    """Current RSS of this process's descendants (vLLM workers), from /proc."""
    out = []
    me = os.getpid()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) != me:
                continue
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        out.append(int(line.split()[1]) / 1024)
        except (OSError, IndexError, ValueError):
            continue
    return out


def _pool_stats(gen) -> dict | None:
    from speculators_compat.exchange import WINDOW

    pool = getattr(gen, "_speculators_compat_pool", None)
    if pool is None:
        return None
    return {"capacity_bytes": pool.capacity, "recent_peak_call_bytes": pool.peak_call_bytes,
            "recent_peak_demand_bytes": pool.peak_demand, "window_calls": WINDOW, **pool.stats}


def _vllm_extract(xllm, prompts, sp) -> list[dict]:
    """vLLM's own extraction, to host tensors: generate, then load (and remove) each request's
    safetensors file, as a user of that path must."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
        load_hidden_states,
    )

    outs = xllm.generate([{"prompt_token_ids": q} for q in prompts], sp, use_tqdm=False)
    loaded = []
    for o in outs:
        path = o.kv_transfer_params["hidden_states_path"]
        loaded.append(load_hidden_states(path))
        cleanup_hidden_states(path)
    return loaded


def _worker_peaks(self):
    """(In a vLLM worker) device memory of this worker's torch allocator."""
    import torch

    now = torch.cuda.memory_allocated()
    peak = torch.cuda.max_memory_allocated()
    return {"allocated_now": now, "max_allocated": peak, "transient_peak": peak - now}


def _op_probe(self=None):
    """Threads of this process, and the cost of 400 tiny CPU torch ops and of a 1 MB host copy: a
    worker whose other threads hold the GIL shows slower ops here than the driver does."""
    import sys
    import threading
    import time

    import numpy as np
    import torch

    x = torch.zeros(4)
    t = time.perf_counter()
    for _ in range(400):
        x = x + 1
    ops = (time.perf_counter() - t) / 400
    a = np.ones(1 << 20, dtype=np.uint8)
    t = time.perf_counter()
    for _ in range(10):
        b = a.copy()
    copy = (time.perf_counter() - t) / 10
    del b
    return {"op_us": ops * 1e6, "copy_1mb_us": copy * 1e6, "switch_interval_s": sys.getswitchinterval(),
            "threads": sorted(th.name for th in threading.enumerate())}


def _worker_reset_peaks(self):
    import torch

    torch.cuda.reset_peak_memory_stats()
    return True


def _engines(gen, llm, xllm):
    calls = [("shim", gen.executor.collective_rpc)]
    calls += [(n, e.collective_rpc) for n, e in (("native", llm), ("vllm_extract", xllm)) if e is not None]
    return calls


def _device_reset(gen, llm, xllm) -> None:
    for _, rpc in _engines(gen, llm, xllm):
        rpc(_worker_reset_peaks)


def _device_memory(gen, llm, xllm) -> dict:
    """Device memory of each engine's rank-0 worker over the measured repetitions (peaks reset
    after the warm-up): ``allocated_now`` (weights + KV cache + buffers that stay),
    ``transient_peak`` (activations and, for the shim, capture copies in flight, above that)."""
    out = {}
    for name, rpc in _engines(gen, llm, xllm):
        try:
            out[name] = rpc(_worker_peaks)[0]
        except Exception as exc:  # noqa: BLE001
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def _phase_medians(phases: list[dict]) -> dict:
    """Each numeric phase's median over the repetitions (``iterations`` and labels left out)."""
    return {k: statistics.median(p[k] for p in phases) for k in (phases[0] if phases else {})
            if k != "iterations" and isinstance(phases[0][k], (int, float))}


def median_ci95(values: list[float]) -> list[float] | None:
    """Distribution-free 95 % confidence interval of the median of paired per-repetition ratios:
    order statistics (k, n+1-k) with the largest k such that P(Binomial(n, 1/2) < k) <= 2.5 %.
    None below 6 values (no such k)."""
    import math

    xs = sorted(values)
    n = len(xs)
    k, cum = 0, 0.0
    while True:
        p = math.comb(n, k) / 2**n
        if cum + p > 0.025:
            break
        cum += p
        k += 1
    if k == 0:
        return None
    return [xs[k - 1], xs[n - k]]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="llama")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--capture", default=None, help="layer ids to capture (default: 3 spread layers)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, nargs="+", default=[256])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--reps-at",
        nargs="+",
        default=[],
        metavar="LEN=N",
        help="repetitions for one prompt length instead of --reps (e.g. 128=41 256=31: short prompts are "
        "cheap and noisy, so more of them narrow the ratios' CI at little cost)",
    )
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--native", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--native-async-scheduling",
        choices=["default", "off"],
        default="default",
        help="off: run vLLM's own engine without async scheduling, as the generator's engine runs",
    )
    p.add_argument("--gpu-util", type=float, default=0.4, help="the generator's gpu_memory_utilization (GPU)")
    p.add_argument(
        "--vllm-extract",
        action="store_true",
        help="also time vLLM's own extraction (speculative method extract_hidden_states + "
        "ExampleHiddenStatesConnector, vLLM >= 0.17): its aux hidden states are the *input* of "
        "layer i, so it captures layers (captured + 1); files go to /dev/shm and are loaded as tensors",
    )
    p.add_argument(
        "--capture-control",
        action="store_true",
        help="also time the same generator class capturing one layer (the last requested): the capture cost "
        "control (a second engine: on a GPU lower --gpu-util / BENCH_GPU_UTIL to fit both)",
    )
    p.add_argument(
        "--self-check-control",
        action="store_true",
        help="also time the same generator with its self-check off (SPECULATORS_COMPAT_SELF_CHECK_ROWS=0 for "
        "those calls): shim / shim_nocheck is what the self-check costs (no second engine)",
    )
    p.add_argument(
        "--settle-calls",
        type=int,
        default=0,
        help="with --self-check-control: this many untimed calls with the check on before the reps, so "
        "SPECULATORS_COMPAT_SELF_CHECK_BUDGET reaches a long job's steady state (the first check's one-time "
        "cost amortised); the calls checked during the reps are recorded",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    try:
        reps_at = {int(k): int(v) for k, v in (x.split("=", 1) for x in args.reps_at)}
    except ValueError:
        p.error(f"--reps-at expects LEN=N pairs of integers; found {args.reps_at}")
    if any(n < 1 for n in reps_at.values()) or args.reps < 1:
        p.error("repetitions must be at least 1")

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    # the generator spawns its workers only while it is built; the vllm.LLM engines built after it in
    # this process must not fork either (the driver asked torch.cuda.is_available())
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    # the device-memory readout sends a function to vLLM's workers through LLM.collective_rpc
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    import speculators_compat  # noqa: F401
    import torch
    from speculators_compat_testbed.reference import relative_error
    from speculators_compat_testbed.tiny_models import build_tiny_model, vllm_env

    platform = "cuda" if torch.cuda.is_available() else "cpu"
    for k, v in vllm_env(args.arch, platform).items():
        os.environ.setdefault(k, v)
    model = build_tiny_model(args.arch, num_layers=args.layers, hidden_size=args.hidden, dtype=args.dtype)
    capture = [int(x) for x in args.capture.split(",")] if args.capture else sorted({1, args.layers // 2, args.layers - 1})

    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

    t = time.perf_counter()
    gen_kw = {"gpu_memory_utilization": args.gpu_util} if platform == "cuda" else {}
    gen = VllmHiddenStatesGenerator(str(model), layer_ids=capture, max_model_len=args.max_model_len, **gen_kw)
    init_shim = time.perf_counter() - t
    gen1 = None
    init_shim_1layer = None
    if args.capture_control:
        t = time.perf_counter()
        gen1 = VllmHiddenStatesGenerator(str(model), layer_ids=[capture[-1]], max_model_len=args.max_model_len,
                                         **gen_kw)
        init_shim_1layer = time.perf_counter() - t
    llm = None
    xllm = None
    init_native = None
    init_extract = None
    from vllm import LLM, SamplingParams

    # vLLM's own engines (native prefill, its own extraction) share these settings
    kw = dict(
        model=str(model),
        enforce_eager=True,
        dtype="auto",
        max_model_len=args.max_model_len,
        max_num_seqs=32,
        max_num_batched_tokens=max(8192, args.max_model_len),
        enable_prefix_caching=False,
    )
    if args.native_async_scheduling == "off":
        kw["async_scheduling"] = False
    if platform == "cuda":
        kw["gpu_memory_utilization"] = float(os.environ.get("BENCH_GPU_UTIL", "0.3"))
        if os.environ.get("SPECULATORS_COMPAT_ATTENTION_BACKEND"):
            kw["attention_config"] = {"backend": os.environ["SPECULATORS_COMPAT_ATTENTION_BACKEND"]}
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    if args.native:
        t = time.perf_counter()
        llm = LLM(**kw)
        init_native = time.perf_counter() - t
    if args.vllm_extract:
        import tempfile

        store = tempfile.mkdtemp(prefix="vllm-extract-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        xkw = dict(kw)
        xkw["speculative_config"] = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [c + 1 for c in capture]}},
        }
        xkw["kv_transfer_config"] = {
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": store},
        }
        t = time.perf_counter()
        xllm = LLM(**xkw)
        init_extract = time.perf_counter() - t

    rows = []
    rng = random.Random(0)
    for plen in args.prompt_len:
        prompts = [[rng.randrange(4, 1000) for _ in range(plen)] for _ in range(args.batch)]
        tokens = plen * args.batch
        # warm-up: every side once, timed, reported apart from the repetitions
        warmup_s = {}
        t = time.perf_counter()
        first = gen.generate(prompts)
        warmup_s["shim"] = time.perf_counter() - t
        if gen1 is not None:
            t = time.perf_counter()
            gen1.generate(prompts)
            warmup_s["shim_1layer"] = time.perf_counter() - t
        if llm is not None:
            t = time.perf_counter()
            llm.generate([{"prompt_token_ids": q} for q in prompts], sp, use_tqdm=False)
            warmup_s["native"] = time.perf_counter() - t
        agreement = None
        if xllm is not None:
            t = time.perf_counter()
            loaded = _vllm_extract(xllm, prompts, sp)
            warmup_s["vllm_extract"] = time.perf_counter() - t
            # the same residual stream: shim's output of layer c vs vLLM's input of layer c + 1
            agreement = max(
                relative_error(first[i]["hidden_states"][k], loaded[i]["hidden_states"][:, k]) for i in range(len(prompts)) for k in range(len(capture))
            )
        del first
        if platform == "cuda":
            _device_reset(gen, llm, xllm)
        shim_s, native_s, extract_s, shim1_s, phases, orders = [], [], [], [], [], []
        phases1: list[dict] = []
        nocheck_s: list[float] = []
        nocheck_phases: list[dict] = []
        if args.self_check_control:  # its warm-up, apart like the others
            os.environ["SPECULATORS_COMPAT_SELF_CHECK_ROWS"] = "0"
            t = time.perf_counter()
            gen.generate(prompts)
            warmup_s["shim_nocheck"] = time.perf_counter() - t
            del os.environ["SPECULATORS_COMPAT_SELF_CHECK_ROWS"]
            t = time.perf_counter()
            for _ in range(args.settle_calls):  # the budget's steady state, apart from the reps
                gen.generate(prompts)
            warmup_s["settle"] = time.perf_counter() - t
        tally_before = dict(getattr(gen, "_speculators_compat_self_check", None) or {})

        def run_shim():
            t = time.perf_counter()
            res = gen.generate(prompts)
            shim_s.append(time.perf_counter() - t)
            phases.append(dict(getattr(gen, "_speculators_compat_timings", {}) or {}))
            assert len(res) == len(prompts) and res[0]["hidden_states"][0].shape[0] == plen

        def run_shim1():
            t = time.perf_counter()
            res = gen1.generate(prompts)
            shim1_s.append(time.perf_counter() - t)
            phases1.append(dict(getattr(gen1, "_speculators_compat_timings", {}) or {}))
            assert len(res) == len(prompts) and len(res[0]["hidden_states"]) == 1

        def run_nocheck():
            # a job has no check-off calls: this arm's calls are kept out of the budget's tally, so
            # the check-on arm is checked as often as in a job of check-on calls only
            tally = copy.deepcopy(getattr(gen, "_speculators_compat_self_check", None))
            os.environ["SPECULATORS_COMPAT_SELF_CHECK_ROWS"] = "0"
            try:
                t = time.perf_counter()
                res = gen.generate(prompts)
                nocheck_s.append(time.perf_counter() - t)
                nocheck_phases.append(dict(getattr(gen, "_speculators_compat_timings", {}) or {}))
            finally:
                del os.environ["SPECULATORS_COMPAT_SELF_CHECK_ROWS"]
                setattr(gen, "_speculators_compat_self_check", tally)
            assert len(res) == len(prompts) and res[0]["hidden_states"][0].shape[0] == plen

        def run_native():
            t = time.perf_counter()
            llm.generate([{"prompt_token_ids": q} for q in prompts], sp, use_tqdm=False)
            native_s.append(time.perf_counter() - t)

        def run_extract():
            t = time.perf_counter()
            loaded = _vllm_extract(xllm, prompts, sp)
            extract_s.append(time.perf_counter() - t)
            del loaded

        sides = [("shim", run_shim)]
        sides += [("native", run_native)] if llm is not None else []
        sides += [("vllm_extract", run_extract)] if xllm is not None else []
        sides += [("shim_1layer", run_shim1)] if gen1 is not None else []
        sides += [("shim_nocheck", run_nocheck)] if args.self_check_control else []
        for r in range(reps_at.get(plen, args.reps)):
            k = r % len(sides)
            order = sides[k:] + sides[:k]  # rotate: each side leads in turn
            orders.append([name for name, _ in order])
            for _, fn in order:
                if platform == "cuda":
                    torch.cuda.synchronize()
                fn()
        row = {
            "driver": phases[0].get("driver") if phases else None,
            "order_per_rep": orders,
            "warmup_s": warmup_s,
            "warmup_tok_s": {k: tokens / v for k, v in warmup_s.items()},
            "prompt_len": plen,
            "batch": args.batch,
            "reps": len(shim_s),
            "tokens": tokens,
            "shim_tok_s": [tokens / s for s in shim_s],
            "shim_median_tok_s": tokens / statistics.median(shim_s),
            "shim_phase_s": phases,
            "shim_phase_median_s": _phase_medians(phases),
        }
        if native_s:
            row["native_tok_s"] = [tokens / s for s in native_s]
            row["native_median_tok_s"] = tokens / statistics.median(native_s)
            ratios = [n / s for s, n in zip(shim_s, native_s)]  # shim tok/s over native tok/s
            row["ratio_median"] = statistics.median(ratios)
            row["ratio_min"] = min(ratios)
            row["ratio_max"] = max(ratios)
        if shim1_s:
            row["shim_1layer_tok_s"] = [tokens / s for s in shim1_s]
            row["shim_1layer_median_tok_s"] = tokens / statistics.median(shim1_s)
            cost = [a / b for a, b in zip(shim_s, shim1_s)]  # time with the requested layers / with one layer
            row["capture_cost_median"] = statistics.median(cost)  # > 1: what the extra layers cost
            row["capture_cost_min"] = min(cost)
            row["capture_cost_max"] = max(cost)
            row["capture_cost_median_ci95"] = median_ci95(cost)
            row["shim_1layer_phase_s"] = phases1  # per repetition, paired with shim_phase_s
            row["shim_1layer_phase_median_s"] = _phase_medians(phases1)  # where the extra layers' time goes (vs shim_phase_median_s)
            row["call_median_s"] = {"shim": statistics.median(shim_s), "shim_1layer": statistics.median(shim1_s)}
            if native_s:
                # shim/native = (shim_1layer/native: driver vs LLM front end) x (shim/shim_1layer: capture)
                row["driver_vs_native_median"] = statistics.median(n / s1 for s1, n in zip(shim1_s, native_s))
        if nocheck_s:
            row["shim_nocheck_tok_s"] = [tokens / s for s in nocheck_s]
            row["shim_nocheck_median_tok_s"] = tokens / statistics.median(nocheck_s)
            cost = [a / b for a, b in zip(shim_s, nocheck_s)]  # time with the self-check / without
            row["self_check_cost_median"] = statistics.median(cost)  # > 1: what the self-check costs
            row["self_check_cost_min"] = min(cost)
            row["self_check_cost_max"] = max(cost)
            row["self_check_cost_median_ci95"] = median_ci95(cost)
            row["self_check_tally"] = getattr(gen, "_speculators_compat_self_check", None)
            after = row["self_check_tally"] or {}
            row["settle_calls"] = args.settle_calls
            row["checked_calls_during_reps"] = after.get("checked_calls", 0) - tally_before.get("checked_calls", 0)
            # the check-on arm's calls during the reps, as the budget weighed them (check_s doubled)
            reps_tally = {k: after.get(k, 0) - tally_before.get(k, 0) for k in ("calls", "checked_calls", "call_s", "check_s")}
            from speculators_compat.extraction.selfcheck import UNTIMED_FACTOR

            reps_tally["budgeted_share"] = (UNTIMED_FACTOR * reps_tally["check_s"] / reps_tally["call_s"]
                                            if reps_tally["call_s"] else None)
            reps_tally["check_s_per_checked_call"] = (reps_tally["check_s"] / reps_tally["checked_calls"]
                                                      if reps_tally["checked_calls"] else None)
            row["self_check_budget_during_reps"] = reps_tally
            row["self_check_budget"] = os.environ.get("SPECULATORS_COMPAT_SELF_CHECK_BUDGET", "default")
            row["nocheck_calls_in_budget"] = False
            row["shim_nocheck_phase_s"] = nocheck_phases  # per repetition, paired with shim_phase_s
            row["shim_nocheck_phase_median_s"] = _phase_medians(nocheck_phases)  # where the self-check's time goes (vs shim_phase_median_s)
        if extract_s:
            row["vllm_extract_tok_s"] = [tokens / s for s in extract_s]
            row["vllm_extract_median_tok_s"] = tokens / statistics.median(extract_s)
            xr = [x / s for s, x in zip(shim_s, extract_s)]  # shim tok/s over vLLM-extract tok/s
            row["ratio_vs_vllm_extract_median"] = statistics.median(xr)
            row["ratio_vs_vllm_extract_min"] = min(xr)
            row["ratio_vs_vllm_extract_max"] = max(xr)
            row["vllm_extract_max_rel_err_vs_shim"] = agreement
        if platform == "cuda":
            row["device_memory"] = _device_memory(gen, llm, xllm)
        try:  # is a tiny op dearer in the generator's worker than here? (GIL holders there)
            row["op_probe"] = {"driver": _op_probe(), "shim_worker": gen.executor.collective_rpc(_op_probe)[0]}
        except Exception as exc:  # noqa: BLE001
            row["op_probe"] = {"error": f"{type(exc).__name__}: {exc}"}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not isinstance(v, list)}), flush=True)
        print(json.dumps({"exchange_pool": _pool_stats(gen)}), flush=True)

    from speculators_compat.versions import installed_versions

    from speculators_compat_testbed.provenance import portable_command, provenance, scrub_paths

    out = {
        "provenance": provenance(),
        "command": portable_command(),
        "platform": platform,
        "device": torch.cuda.get_device_name(0) if platform == "cuda" else os.uname().machine,
        "versions": {k: v.version for k, v in installed_versions().items()},
        "model": {"arch": args.arch, "hidden": args.hidden, "layers": args.layers, "dtype": args.dtype, "captured": capture},
        "init_s": {"shim": init_shim, "native": init_native, "vllm_extract": init_extract,
                   "shim_1layer": init_shim_1layer},
        "rows": rows,
        "exchange_pool": _pool_stats(gen),
        "host_memory": {**_rss_mb(), "worker_rss_mb_now": _worker_rss_mb()},
        "attention_backend": os.environ.get("SPECULATORS_COMPAT_ATTENTION_BACKEND"),
        "native_async_scheduling": args.native_async_scheduling,
    }
    text = json.dumps(scrub_paths(out), indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
