"""Extraction throughput: speculators' generator under the shim vs vLLM's own prefill.

One process, one model, the same prompts and batch shape; the two are timed alternately over
several repetitions (median and spread). Native = ``vllm.LLM.generate(prompts,
SamplingParams(max_tokens=1))`` with the engine settings the generator uses (eager, prefix
caching off, max_num_seqs 32, max_num_batched_tokens max(8192, max_model_len)).

    python benchmarks/throughput.py --hidden 512 --layers 6 --batch 16 --prompt-len 256 --reps 5 --out r.json

Writes a JSON with both sides' tokens/s per repetition, medians, spread and the ratio, plus
the peak host RSS of this process and its children and (GPU) peak device memory.
"""

from __future__ import annotations

import argparse
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
    pool = getattr(gen, "_speculators_compat_pool", None)
    if pool is None:
        return None
    return {"capacity_bytes": pool.capacity, "peak_call_bytes": pool.peak_call_bytes, **pool.stats}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="llama")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--capture", default=None, help="layer ids to capture (default: 3 spread layers)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, nargs="+", default=[256])
    p.add_argument("--reps", type=int, default=5)
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
    p.add_argument("--out", default=None)
    args = p.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import speculators_compat  # noqa: F401
    import torch
    from speculators_compat.testing.tiny_models import build_tiny_model, vllm_env

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
    llm = None
    init_native = None
    if args.native:
        from vllm import LLM, SamplingParams

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
        t = time.perf_counter()
        llm = LLM(**kw)
        init_native = time.perf_counter() - t
        sp = SamplingParams(max_tokens=1, temperature=0.0)

    rows = []
    rng = random.Random(0)
    for plen in args.prompt_len:
        prompts = [[rng.randrange(4, 1000) for _ in range(plen)] for _ in range(args.batch)]
        tokens = plen * args.batch
        # warm-up both
        gen.generate(prompts)
        if llm is not None:
            llm.generate([{"prompt_token_ids": q} for q in prompts], sp, use_tqdm=False)
        shim_s, native_s, phases = [], [], []
        for _ in range(args.reps):
            if platform == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            res = gen.generate(prompts)
            shim_s.append(time.perf_counter() - t)
            phases.append(dict(getattr(gen, "_speculators_compat_timings", {}) or {}))
            assert len(res) == len(prompts) and res[0]["hidden_states"][0].shape[0] == plen
            del res
            if llm is not None:
                t = time.perf_counter()
                llm.generate([{"prompt_token_ids": q} for q in prompts], sp, use_tqdm=False)
                native_s.append(time.perf_counter() - t)
        row = {
            "prompt_len": plen,
            "batch": args.batch,
            "tokens": tokens,
            "shim_tok_s": [tokens / s for s in shim_s],
            "shim_median_tok_s": tokens / statistics.median(shim_s),
            "shim_phase_s": phases,
            "shim_phase_median_s": {
                k: statistics.median(p[k] for p in phases) for k in (phases[0] if phases else {}) if k != "iterations"
            },
        }
        if native_s:
            row["native_tok_s"] = [tokens / s for s in native_s]
            row["native_median_tok_s"] = tokens / statistics.median(native_s)
            ratios = [n / s for s, n in zip(shim_s, native_s)]  # shim tok/s over native tok/s
            row["ratio_median"] = statistics.median(ratios)
            row["ratio_min"] = min(ratios)
            row["ratio_max"] = max(ratios)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not isinstance(v, list)}), flush=True)
        print(json.dumps({"exchange_pool": _pool_stats(gen)}), flush=True)

    from speculators_compat.versions import installed_versions

    out = {
        "command": " ".join(sys.argv),
        "platform": platform,
        "device": torch.cuda.get_device_name(0) if platform == "cuda" else os.uname().machine,
        "versions": {k: v.version for k, v in installed_versions().items()},
        "model": {"arch": args.arch, "hidden": args.hidden, "layers": args.layers, "dtype": args.dtype, "captured": capture},
        "init_s": {"shim": init_shim, "native": init_native},
        "rows": rows,
        "exchange_pool": _pool_stats(gen),
        "host_memory": {**_rss_mb(), "worker_rss_mb_now": _worker_rss_mb()},
        "attention_backend": os.environ.get("SPECULATORS_COMPAT_ATTENTION_BACKEND"),
        "native_async_scheduling": args.native_async_scheduling,
    }
    text = json.dumps(out, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
