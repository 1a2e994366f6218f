"""One end-to-end cell: speculators' real generator on the installed vLLM, against HF.

Run as a script (CPU vLLM spawns its workers, so this needs its own ``__main__``)::

    python -m speculators_compat.testing.e2e_runner --arch llama --out result.json [--unpatched]

It builds a tiny model, constructs ``VllmHiddenStatesGenerator`` (whatever speculators release
is installed) and runs a battery:

- ``mixed``: six sequences of mixed lengths in non-sorted order, several longer than a KV block;
- ``chunked``: twelve sequences whose total exceeds ``max_num_batched_tokens`` (chunked prefill
  across scheduler steps; more than ten sequences, which 0.4.x's string sort misorders);
- ``repeat``: ``mixed`` again on the same generator: results must be bit-identical;
- ``truncated``: a sequence longer than ``max_model_len``: must come back with
  ``max_model_len - 1`` tokens, equal to HF on the kept tokens.

Every captured tensor is compared with HF transformers on the same weights (forward hooks on
the decoder layers, the dtype the engine computed in; tolerance per dtype from
``reference.TOLERANCE``). With ``--unpatched`` the shim is disabled (in every process) and the
runner records how the generator fails. The JSON it writes is what tests, the demo, the
tested-table generator and the GPU script read.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback


def _lengths_mixed():
    return [40, 7, 300, 17, 1200, 33]


def _lengths_chunked(rng):
    return [rng.randrange(600, 1300) for _ in range(12)]


def _sequences(lengths, rng, vocab):
    return [[rng.randrange(4, vocab) for _ in range(n)] for n in lengths]


def _force_engine_dtype(dtype: str) -> None:
    """Make the generator's engine compute in ``dtype``.

    speculators builds ``ModelConfig(dtype="auto")`` itself, and vLLM's "auto" downcasts a
    float32 checkpoint to the platform's preferred dtype (bf16 on CPU). For mixture-of-experts
    models bf16 is not a usable reference: near-tied router scores pick different experts in
    two correct implementations (tiny_models.MOE_ARCHITECTURES; HF bf16 vs HF fp32 alone differs
    by up to ~18% on some tokens), so a decisive check of the capture runs them in float32.
    Test-harness only: wraps the ``ModelConfig`` name speculators' module calls.
    """
    from speculators.data_generation import vllm_hidden_states_generator as gen

    original = gen.ModelConfig

    def model_config(*args, **kwargs):
        kwargs["dtype"] = dtype
        return original(*args, **kwargs)

    gen.ModelConfig = model_config


def _platform() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def run(args, progress=None) -> dict:
    say = progress or (lambda msg: None)
    if args.unpatched:
        # `python -m speculators_compat.testing...` has imported (and activated) the package
        # already: deactivate here, and disable it for the workers through the environment.
        os.environ["SPECULATORS_COMPAT_DISABLE"] = "1"
        import speculators_compat

        speculators_compat.deactivate()
    from speculators_compat.testing import tiny_models

    platform = _platform() if args.platform == "auto" else args.platform
    for key, value in tiny_models.vllm_env(args.arch, platform).items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    import speculators_compat  # noqa: F401 - activates (unless disabled)

    engine_dtype = args.dtype
    if engine_dtype == "auto" and platform == "cpu" and args.arch in tiny_models.MOE_ARCHITECTURES:
        # bf16 is no reference for MoE: near-tied router scores pick different experts in two
        # correct implementations (HF bf16 vs HF fp32 alone: up to 18%; benchmarks/results/arch)
        engine_dtype = "float32"
    if engine_dtype != "auto":
        _force_engine_dtype(engine_dtype)

    from speculators_compat.versions import installed_versions

    versions = {k: v.version for k, v in installed_versions().items()}
    result: dict = {
        "arch": args.arch,
        "platform": platform,
        "versions": versions,
        "unpatched": bool(args.unpatched),
        "engine_dtype": engine_dtype,
        "cases": {},
    }
    say(f"building tiny {args.arch} model ({args.num_layers} layers, hidden {args.hidden_size})")
    overrides = json.loads(args.overrides) if args.overrides else None
    result["overrides"] = overrides
    model_dir = tiny_models.build_tiny_model(
        args.arch, num_layers=args.num_layers, hidden_size=args.hidden_size, overrides=overrides
    )
    result["model_dir"] = str(model_dir)
    layer_ids = [int(x) for x in args.layers.split(",")] if args.layers else None

    t0 = time.perf_counter()
    try:
        from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

        say("starting speculators' VllmHiddenStatesGenerator on vLLM (model load + engine start: tens of seconds on CPU)")
        kwargs = {"layer_ids": layer_ids, "max_model_len": args.max_model_len}
        if args.gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
        if args.tensor_parallel_size != 1:
            kwargs["tensor_parallel_size"] = args.tensor_parallel_size
        result["tensor_parallel_size"] = args.tensor_parallel_size
        generator = VllmHiddenStatesGenerator(str(model_dir), **kwargs)
        result["init_s"] = time.perf_counter() - t0
        rng = random.Random(args.seed)
        vocab = generator.tokenizer.vocab_size if hasattr(generator.tokenizer, "vocab_size") else 1000
        vocab = min(vocab, 1000)
        batches = {
            "mixed": _sequences(_lengths_mixed(), rng, vocab),
            "chunked": _sequences(_lengths_chunked(rng), rng, vocab),
            "truncated": _sequences([args.max_model_len + 50, 12], rng, vocab),
        }
        outputs = {}
        say(f"engine ready in {result['init_s']:.1f}s; extracting hidden states")
        for name in ("mixed", "chunked", "truncated"):
            say(f"  generate: {name} batch ({len(batches[name])} sequences, {sum(len(x) for x in batches[name])} tokens)")
            t = time.perf_counter()
            outputs[name] = generator.generate(batches[name])
            result["cases"][name] = {"seconds": time.perf_counter() - t, "tokens": sum(len(s) for s in batches[name])}
        outputs["repeat"] = generator.generate(batches["mixed"])
    except BaseException as exc:  # noqa: BLE001 - the failure is the result
        result["error"] = {"type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}
        result["init_s"] = result.get("init_s")
        return result

    # What applied: in this process, and in the worker (asked over the shim's RPC).
    result["patches"] = [r for r in speculators_compat.report() if r["status"] != "pending"]
    try:
        from speculators_compat.patches.worker_capture import RPC_NAME

        replies = generator.executor.collective_rpc(RPC_NAME, args=("describe",))
        worker = replies[0]["value"] if replies and replies[0].get("ok") else replies[0]
        result["worker"] = worker
    except Exception as exc:  # noqa: BLE001
        result["worker"] = {"error": f"{type(exc).__name__}: {exc}"}

    import torch

    from speculators_compat.testing.reference import compare, hf_layer_outputs

    say("computing the HF transformers reference (forward hooks on the decoder layers)")
    captured_dtype = outputs["mixed"][0]["hidden_states"][0].dtype
    ids = sorted(set(generator.layer_ids))
    result["layer_ids"] = ids
    result["dtype"] = str(captured_dtype).replace("torch.", "")
    max_keep = args.max_model_len - 1
    device = "cuda" if platform == "cuda" else "cpu"
    for name in ("mixed", "chunked", "truncated"):
        seqs = [s[:max_keep] for s in batches[name]]
        out = outputs[name]
        case = result["cases"][name]
        case["lengths_in"] = [len(s) for s in batches[name]]
        case["lengths_out"] = [int(o["input_ids"].shape[0]) for o in out]
        case["shapes_ok"] = all(
            len(o["hidden_states"]) == len(ids)
            and all(tuple(h.shape) == (len(s), o["hidden_states"][0].shape[-1]) for h in o["hidden_states"])
            and o["input_ids"].tolist() == s
            for o, s in zip(out, seqs)
        )
        ref = hf_layer_outputs(model_dir, seqs, ids, dtype=captured_dtype, device=device)
        # MoE: a single near-tie may still flip an expert in float32 (seen: 1 token of gpt_oss)
        outliers = 0.01 if args.arch in tiny_models.MOE_ARCHITECTURES else 0.0
        rep = compare(
            [[h.to(device) for h in o["hidden_states"]] for o in out], ref, dtype=captured_dtype,
            max_outlier_fraction=outliers,
        )
        case["max_error"] = rep.max_error
        case["tolerance"] = rep.tolerance
        case["passed"] = rep.passed and case["shapes_ok"]
        case["summary"] = rep.summary()
        case["tokens_per_s"] = case["tokens"] / case["seconds"] if case["seconds"] else None
    result["cases"]["repeat"] = {
        "identical": all(
            all(torch.equal(a, b) for a, b in zip(x["hidden_states"], y["hidden_states"]))
            for x, y in zip(outputs["mixed"], outputs["repeat"])
        )
    }
    result["passed"] = all(result["cases"][n]["passed"] for n in ("mixed", "chunked", "truncated")) and result["cases"][
        "repeat"
    ]["identical"]
    try:
        generator.executor.shutdown()
    except Exception:  # noqa: BLE001
        pass
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--out", default=None, help="write the JSON result here (default: stdout)")
    parser.add_argument("--unpatched", action="store_true", help="disable the shim in every process")
    parser.add_argument("--layers", default=None)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="the generator's own TP path (capture on TP rank 0)"
    )
    parser.add_argument("--platform", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="engine dtype (default: speculators' 'auto', i.e. bf16 for these float32 checkpoints on CPU); "
        "float32 gives MoE archs a decisive comparison",
    )
    parser.add_argument("--overrides", default=None, help="JSON of model config keys (e.g. MLA dims for GPU kernels)")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    result = run(args)
    text = json.dumps(result, indent=2, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)
    sys.stdout.flush()
    # exit at once: engine/worker teardown in interpreter shutdown can hang on some versions
    os._exit(0)


if __name__ == "__main__":
    main()
