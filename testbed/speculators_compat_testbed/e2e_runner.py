"""One end-to-end cell: speculators' real generator on the installed vLLM, against HF.

Run as a script (CPU vLLM spawns its workers, so this needs its own ``__main__``)::

    python -m speculators_compat_testbed.e2e_runner --arch llama --out result.json [--unpatched]

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
``reference.TOLERANCE``). ``--reference vllm`` compares with the same vLLM engine's own forward
instead (shim disabled, hooks on its decoder layers: ``testing.vllm_reference``), for configs HF
does not implement; a config that sets ``llama_4_scaling`` (DeepSeek-V3, vLLM >= 0.12) is also
compared with HF plus the harness's scaling and, as negative controls, with plain HF and vLLM's
forward with the scaling off (``testing.llama4_scaling``). With ``--unpatched`` the shim is disabled (in every process) and the
runner records how the generator fails. The JSON it writes is what tests, the demo, the
tested-table generator and the GPU script read.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import sys
import time
import traceback


def _lengths_mixed():
    return [40, 7, 300, 17, 1200, 33]


def _lengths_chunked(rng):
    return [rng.randrange(600, 1300) for _ in range(12)]


def _sequences(lengths, rng, vocab, bos=1):
    """Random prompts that open with BOS, as chat-templated prompts do (position 0 is where a
    trained model's very-high-norm row sits; tiny_models.MASSIVE)."""
    return [[bos] + [rng.randrange(4, vocab) for _ in range(n - 1)] for n in lengths]


def _shim_active() -> bool:
    import speculators_compat

    return bool(speculators_compat.get_registry().active)


def _engine_setting(setting: str, keyword: str, name: str, value) -> str:
    """Give the generator's engine ``keyword=value``: through the shim's ``setting`` (its patch of
    ``name`` in speculators' module reads it); with the shim disabled (a native control run),
    by wrapping ``name`` there (nothing else owns it then). Returns how. The module is imported
    first: the shim activates on that import, so whether it is active is known only after it."""
    os.environ[setting] = str(value)
    from speculators.data_generation import vllm_hidden_states_generator as gen

    if _shim_active():
        return setting
    original = getattr(gen, name)

    def with_value(*args, **kwargs):
        kwargs[keyword] = value
        return original(*args, **kwargs)

    setattr(gen, name, with_value)
    return f"harness: {name}({keyword}=) in the generator's module (shim disabled)"


def _force_engine_dtype(dtype: str) -> str:
    """Make the generator's engine compute in ``dtype`` (speculators builds
    ``ModelConfig(dtype="auto")``; vLLM's "auto" downcasts a float32 checkpoint to bf16 on CPU).
    For mixture-of-experts models bf16 is no reference: near-tied router scores pick different
    experts in two correct implementations (HF bf16 vs HF fp32 alone: up to ~18% on some tokens),
    so a decisive check of the capture runs in float32."""
    return _engine_setting("SPECULATORS_COMPAT_DTYPE", "dtype", "ModelConfig", dtype)


def _platform() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def run(args, progress=None) -> dict:
    """One cell: build the tiny model, extract hidden states with speculators' generator, compare
    every case with the reference(s); returns the result dict the runner writes as JSON."""
    say = progress or (lambda msg: None)
    platform, engine_dtype, engine_dtype_via = _prepare_process(args)
    result, versions = _start_result(args, platform, engine_dtype, engine_dtype_via)
    model_dir, hf_dir = _tiny_model(args, result, say)
    result["max_model_len"] = args.max_model_len
    layer_ids = [int(x) for x in args.layers.split(",")] if args.layers else None

    extracted = _extract_hidden_states(args, result, model_dir, layer_ids, engine_dtype, say)
    if extracted is None:  # the failure is the result
        return result
    generator, batches, outputs = extracted
    _record_engine(result, generator)

    say("computing the HF transformers reference (forward hooks on the decoder layers)")
    captured_dtype = outputs["mixed"][0]["hidden_states"][0].dtype
    ids = sorted(generator.layer_ids)  # one tensor per requested id (a repeated id: its layer again)
    result["layer_ids"] = ids
    result["dtype"] = str(captured_dtype).replace("torch.", "")
    max_keep = args.max_model_len - 1
    device = "cuda" if platform == "cuda" else "cpu"
    seqs_by_case = {name: [s[:max_keep] for s in batches[name]] for name in ("mixed", "chunked", "truncated")}

    references, controls, ref_margins, l4s = _hf_references(result, model_dir, hf_dir, ids, seqs_by_case, captured_dtype,
                                                            device, say)
    spreads = _hf_spreads(result, references, hf_dir, ids, seqs_by_case, captured_dtype, device, say)
    primary = _vllm_reference_or_hf(args, result, model_dir, ids, seqs_by_case, captured_dtype, platform, versions, l4s,
                                    references, controls, ref_margins, say)
    result["reference"] = primary

    _compare_references(args, result, outputs, seqs_by_case, ids, captured_dtype, device, l4s, references, controls,
                        ref_margins, spreads)
    _case_verdicts(result, outputs, batches, seqs_by_case, ids, captured_dtype, primary)
    settle = getattr(args, "settle", None)
    if settle == "always" or (settle == "on-fail" and not result["passed"]):
        say("the reference disagrees: the same engine's own forward (shim off), scheduled as the generator")
        result["settled"] = _settle(args, result, outputs, model_dir, captured_dtype, ids, seqs_by_case, platform, versions)
    from speculators_compat_testbed.provenance import machine

    result["provenance"]["machine"] = machine()  # the GPU is known once the reference ran on it
    return result


def _prepare_process(args) -> tuple[str, str, str | None]:
    """This process's environment (the shim off for ``--unpatched``, the arch's vLLM variables),
    the shim activated unless disabled, and the engine dtype: ``(platform, engine_dtype, via)``."""
    if args.unpatched:
        # `python -m speculators_compat_testbed...` has imported (and activated) the package
        # already: deactivate here, and disable it for the workers through the environment.
        os.environ["SPECULATORS_COMPAT_DISABLE"] = "1"
        import speculators_compat

        speculators_compat.deactivate()
    from speculators_compat_testbed import tiny_models

    platform = _platform() if args.platform == "auto" else args.platform
    for key, value in tiny_models.vllm_env(args.arch, platform).items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # the test bed checks every call (the default budget samples calls by their cost)
    os.environ.setdefault("SPECULATORS_COMPAT_SELF_CHECK_BUDGET", "1")

    import speculators_compat  # noqa: F401 - activates (unless disabled)

    engine_dtype = args.dtype
    if engine_dtype == "auto" and platform == "cpu" and args.arch in tiny_models.MOE_ARCHITECTURES:
        # bf16 is no reference for MoE: near-tied router scores pick different experts in two
        # correct implementations (HF bf16 vs HF fp32 alone: up to 18%; benchmarks/results/arch)
        engine_dtype = "float32"
    engine_dtype_via = _force_engine_dtype(engine_dtype) if engine_dtype != "auto" else None
    return platform, engine_dtype, engine_dtype_via


def _start_result(args, platform: str, engine_dtype: str, engine_dtype_via: str | None) -> tuple[dict, dict]:
    """The result's head (provenance, arch, platform, installed versions, engine dtype) and the versions."""
    from speculators_compat.versions import installed_versions

    from speculators_compat_testbed.provenance import provenance

    versions = {k: v.version for k, v in installed_versions().items()}
    result: dict = {
        "provenance": provenance(getattr(args, "command", None)),
        "arch": args.arch,
        "platform": platform,
        "versions": versions,
        "unpatched": bool(args.unpatched),
        "engine_dtype": engine_dtype,
        "engine_dtype_via": engine_dtype_via,
        "cases": {},
    }
    return result, versions


def _tiny_model(args, result: dict, say):
    """The checkpoint the cell runs (``--model-dir``, or the tiny model built for ``--arch``) and the
    directory HF loads (its dequantized copy for a quantized model): ``(model_dir, hf_dir)``."""
    from speculators_compat_testbed import tiny_models
    from speculators_compat_testbed.provenance import portable_path

    overrides = json.loads(args.overrides) if args.overrides else None
    result["overrides"] = overrides
    quantization = getattr(args, "quantization", None)
    result["quantization"] = quantization
    if getattr(args, "model_dir", None):  # a checkpoint built elsewhere (the rehearsal's shrunk model)
        from pathlib import Path

        model_dir = Path(args.model_dir)
    else:
        say(f"building tiny {args.arch} model ({args.num_layers} layers, hidden {args.hidden_size})")
        model_dir = tiny_models.build_tiny_model(
            args.arch, num_layers=args.num_layers, hidden_size=args.hidden_size, overrides=overrides,
            **({"quantization": quantization} if quantization else {}),
        )
    result["model_dir"] = portable_path(model_dir)  # the cache entry's name, no machine path
    hf_dir = tiny_models.hf_reference_dir(model_dir)  # a quantized model: HF on its dequantized copy
    if hf_dir != model_dir:
        result["hf_model_dir"] = f"{portable_path(model_dir)}/{hf_dir.name}"
    return model_dir, hf_dir


def _extract_hidden_states(args, result: dict, model_dir, layer_ids, engine_dtype: str, say):
    """Start speculators' generator on vLLM and run the batches: ``(generator, batches, outputs)``,
    or None when anything failed (then ``result["error"]`` says what: the failure is the result)."""
    t0 = time.perf_counter()
    try:
        generator = _start_generator(args, result, model_dir, layer_ids, engine_dtype, say, t0)
        batches, outputs = _generate(args, result, generator, say)
    except BaseException as exc:  # noqa: BLE001 - the failure is the result
        result["error"] = {"type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}
        result["init_s"] = result.get("init_s")
        return None
    return generator, batches, outputs


def _start_generator(args, result: dict, model_dir, layer_ids, engine_dtype: str, say, t0: float):
    """speculators' ``VllmHiddenStatesGenerator`` on ``model_dir``, checked to run the engine dtype
    and token budget asked for; records its scheduler and engine settings."""
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

    say("starting speculators' VllmHiddenStatesGenerator on vLLM (model load + engine start: tens of seconds on CPU)")
    kwargs = {"layer_ids": layer_ids, "max_model_len": args.max_model_len}
    if args.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    result["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.max_num_batched_tokens is not None:
        import inspect

        if "max_num_batched_tokens" in inspect.signature(VllmHiddenStatesGenerator.__init__).parameters:
            kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
            result["max_num_batched_tokens_via"] = "generator parameter"
        else:  # speculators 0.3.0
            result["max_num_batched_tokens_via"] = _engine_setting(
                "SPECULATORS_COMPAT_MAX_NUM_BATCHED_TOKENS", "max_num_batched_tokens", "SchedulerConfig",
                args.max_num_batched_tokens)
    if args.tensor_parallel_size != 1:
        kwargs["tensor_parallel_size"] = args.tensor_parallel_size
    result["tensor_parallel_size"] = args.tensor_parallel_size
    generator = VllmHiddenStatesGenerator(str(model_dir), **kwargs)
    result["init_s"] = time.perf_counter() - t0
    model_dtype = str(getattr(getattr(generator.vllm_config, "model_config", None), "dtype", "")).replace("torch.", "")
    if engine_dtype != "auto" and model_dtype != engine_dtype:
        raise RuntimeError(f"expected the generator's engine in {engine_dtype}; found {model_dtype}")
    budget = getattr(generator.vllm_config.scheduler_config, "max_num_batched_tokens", None)
    if args.max_num_batched_tokens is not None and budget != args.max_num_batched_tokens:
        raise RuntimeError(f"expected the generator's engine to take {args.max_num_batched_tokens} tokens per "
                           f"step; found {budget}")
    sc = generator.vllm_config.scheduler_config
    result["scheduler"] = {k: getattr(sc, k) for k in _SCHEDULE_KEYS if isinstance(getattr(sc, k, None), (int, bool))}
    cache_config = getattr(getattr(generator, "vllm_config", None), "cache_config", None)
    result["engine"] = {"block_size": getattr(cache_config, "block_size", None),
                        # the KV blocks bound how much of a batch a step takes (the reference gets as many)
                        "num_gpu_blocks": getattr(cache_config, "num_gpu_blocks", None)}
    custom_ops = getattr(getattr(generator.vllm_config, "compilation_config", None), "custom_ops", None)
    if isinstance(custom_ops, list):  # the kernels it picks (engine-options: CPU rotary op off)
        result["engine"]["custom_ops"] = list(custom_ops)
    return generator


def _generate(args, result: dict, generator, say):
    """The battery through the generator (mixed, chunked, truncated, then mixed again as "repeat"),
    with a planted fault armed first when asked: ``(batches, outputs)``."""
    rng = random.Random(args.seed)
    vocab = generator.tokenizer.vocab_size if hasattr(generator.tokenizer, "vocab_size") else 1000
    vocab = min(vocab, 1000)
    batches = {
        "mixed": _sequences(_lengths_mixed(), rng, vocab),
        "chunked": _sequences(_lengths_chunked(rng), rng, vocab),
        "truncated": _sequences([args.max_model_len + 50, 12], rng, vocab),
    }
    outputs = {}
    if getattr(args, "plant", None):
        from speculators_compat_testbed.fault_runner import _arm_plant

        generator.executor.collective_rpc(_arm_plant, args=(args.plant,))
        result["planted"] = args.plant
    say(f"engine ready in {result['init_s']:.1f}s; extracting hidden states")
    result["generator_schedule"] = {}
    for name in ("mixed", "chunked", "truncated"):
        say(f"  generate: {name} batch ({len(batches[name])} sequences, {sum(len(x) for x in batches[name])} tokens)")
        t = time.perf_counter()
        with _schedule_log(generator) as steps:
            outputs[name] = generator.generate(batches[name])
        result["cases"][name] = {"seconds": time.perf_counter() - t, "tokens": sum(len(s) for s in batches[name])}
        result["generator_schedule"][name] = _per_sequence(steps, len(batches[name]))
    outputs["repeat"] = generator.generate(batches["mixed"])
    timings = getattr(generator, "_speculators_compat_timings", None) or {}
    result["driver"] = timings.get("driver")
    result["self_check"] = getattr(generator, "_speculators_compat_self_check", None)
    return batches, outputs


@contextlib.contextmanager
def _schedule_log(generator):
    """Test-only: the steps this generator's scheduler makes during the block, each as
    {request id: tokens} (its ``schedule`` wrapped on the instance, the class's method back after)."""
    sched, steps = generator.scheduler, []
    original = sched.schedule

    def schedule(*args, **kwargs):
        out = original(*args, **kwargs)
        if out.total_num_scheduled_tokens:
            steps.append(dict(out.num_scheduled_tokens))
        return out

    sched.schedule = schedule
    try:
        yield steps
    finally:
        del sched.schedule


def _per_sequence(steps: list, n: int) -> list:
    """The steps as ``vllm_reference``'s schedule: per sequence [(first position, step, rows)]
    (request ids ``req_<call>_<i>``, as speculators names them)."""
    out, done = [[] for _ in range(n)], [0] * n
    for k, step in enumerate(steps):
        for rid, rows in step.items():
            i = int(str(rid).rsplit("_", 1)[-1])
            out[i].append([done[i], k, rows])
            done[i] += rows
    return out


def _record_engine(result: dict, generator) -> None:
    """What applied: in this process, and in the worker (asked over the shim's RPC); then the
    generator's engine is shut down."""
    import speculators_compat

    result["patches"] = [r for r in speculators_compat.report() if r["status"] != "pending"]
    try:
        from speculators_compat.extraction.driver import describe

        result["worker"] = describe(generator)[0]
    except Exception as exc:  # noqa: BLE001
        result["worker"] = {"error": f"{type(exc).__name__}: {exc}"}

    try:  # before the references: a second engine must not share the 2 CPU cores with this one
        generator.executor.shutdown()
    except Exception:  # noqa: BLE001
        pass


def _hf_references(result: dict, model_dir, hf_dir, ids, seqs_by_case, captured_dtype, device: str, say):
    """HF's layer outputs for every case: the reference (HF, or HF plus the harness's
    llama_4_scaling where HF lacks it, plain HF then a negative control) and each one's router
    margins: ``(references, controls, ref_margins, l4s)``."""
    from speculators_compat_testbed import llama4_scaling
    from speculators_compat_testbed.reference import hf_layer_outputs, load_hf_model

    # References: name -> {case: [[tensor per layer] per sequence]}; negative controls alike.
    l4s = llama4_scaling.config_value(model_dir)
    references: dict = {}
    controls: dict = {}
    # router top-k margins of each reference's own forward (issue #14): name -> {case: [{layer: [len]}]}
    ref_margins: dict = {}
    hf_model = load_hf_model(hf_dir, dtype=captured_dtype, device=device)
    result["hf_class"] = f"{type(hf_model).__module__}.{type(hf_model).__qualname__}"
    hf_plain_margins: dict = {n: [] for n in seqs_by_case}
    hf_plain = {n: hf_layer_outputs(hf_model, seqs, ids, dtype=captured_dtype, device=device, margins=hf_plain_margins[n])
                for n, seqs in seqs_by_case.items()}
    if l4s is not None:
        result["llama_4_scaling"] = {
            "config": l4s,
            "hf_implements": llama4_scaling.hf_implements(hf_model),
            "hf_class": f"{type(hf_model).__module__}.{type(hf_model).__qualname__}",
            "positions": {n: llama4_scaling.stats([len(s) for s in seqs], l4s) for n, seqs in seqs_by_case.items()},
        }
    if l4s is not None and not result["llama_4_scaling"]["hf_implements"]:
        say("HF does not implement llama_4_scaling: HF + the harness's scaling is the HF reference")
        with llama4_scaling.hf_attention_scaling(hf_model, l4s) as calls:
            ref_margins["hf+harness_llama_4_scaling"] = {n: [] for n in seqs_by_case}
            references["hf+harness_llama_4_scaling"] = {
                n: hf_layer_outputs(hf_model, seqs, ids, dtype=captured_dtype, device=device,
                                    margins=ref_margins["hf+harness_llama_4_scaling"][n])
                for n, seqs in seqs_by_case.items()
            }
        result["llama_4_scaling"]["harness_attention_calls"] = calls["n"]
        controls["hf_without_llama_4_scaling"] = hf_plain
    else:
        references["hf"] = hf_plain
        ref_margins["hf"] = hf_plain_margins
    del hf_model
    return references, controls, ref_margins, l4s


def _hf_spreads(result: dict, references: dict, hf_dir, ids, seqs_by_case, captured_dtype, device: str, say) -> dict:
    """For a bf16/fp16 capture against HF: HF's own float32 forward, so each row's bound follows
    HF's bf16-vs-fp32 spread: reference name -> {case: [[row spread [len] per layer] per sequence]}."""
    import torch

    from speculators_compat_testbed.reference import hf_layer_outputs, load_hf_model

    spreads: dict = {}  # reference name -> {case: [[row spread [len] per layer] per sequence]}
    if "hf" in references and captured_dtype in (torch.bfloat16, torch.float16):
        say("computing HF's own float32 forward (each bf16 row's bound follows HF's bf16-vs-fp32 spread)")
        hf32 = load_hf_model(hf_dir, dtype=torch.float32, device=device)
        from speculators_compat_testbed.reference import row_errors

        spreads["hf"] = {}
        for n, seqs in seqs_by_case.items():
            outs32 = hf_layer_outputs(hf32, seqs, ids, dtype=torch.float32, device=device)
            spreads["hf"][n] = [[row_errors(a, b) for a, b in zip(lo, hi)] for lo, hi in zip(references["hf"][n], outs32)]
        del hf32
        result["hf_spread"] = {
            n: {"max": max(float(x.max()) for per in sp for x in per if x.numel()),
                "p99": float(torch.quantile(torch.cat([x for per in sp for x in per]).double(), 0.99))}
            for n, sp in spreads["hf"].items()
        }
    return spreads


def _vllm_reference_or_hf(args, result: dict, model_dir, ids, seqs_by_case, captured_dtype, platform: str, versions: dict,
                          l4s, references: dict, controls: dict, ref_margins: dict, say) -> str:
    """With ``--reference vllm``, add vLLM's own forward (shim off) as the reference; returns the
    name of the primary reference."""
    if args.reference == "vllm":
        say("computing the vLLM own-forward reference (plain vllm.LLM, shim disabled, one prompt at a time)")
        variants = ["own"] + (["llama_4_scaling_off"] if l4s is not None else [])
        try:
            got = _vllm_reference(args, model_dir, captured_dtype, ids, seqs_by_case, variants, platform, versions)
            # vllm_reference returns one tensor per REQUESTED id, as the capture (speculators' default
            # ids repeat one: 1, 2, 2, 3); compare() fails a sequence whose layer counts differ
            result["vllm_reference"] = {k: got[k] for k in ("init_s", "seconds", "vllm", "worker")}
            references["vllm_own_forward"] = got["variants"]["own"]
            if got.get("margins"):
                ref_margins["vllm_own_forward"] = got["margins"]
            result["vllm_reference"]["routers"] = got.get("routers")
            result["vllm_reference"]["margin_problems"] = got.get("margin_problems")
            if "llama_4_scaling_off" in got["variants"]:
                controls["vllm_own_forward_llama_4_scaling_off"] = got["variants"]["llama_4_scaling_off"]
        except Exception as exc:  # noqa: BLE001 - recorded; the cell then fails
            result["vllm_reference"] = {"error": f"{type(exc).__name__}: {exc}"}
        primary = "vllm_own_forward"
    else:
        primary = "hf" if "hf" in references else "hf+harness_llama_4_scaling"
    return primary


def _compare_references(args, result: dict, outputs: dict, seqs_by_case, ids, captured_dtype, device: str, l4s,
                        references: dict, controls: dict, ref_margins: dict, spreads: dict) -> None:
    """Every case's captured rows against every reference (``result["references"]``) and every
    negative control (``result["negative_controls"]``); ``--save-tensors`` writes the raw tensors."""
    import torch

    from speculators_compat_testbed.reference import compare

    captured = {n: [[h.to(device) for h in o["hidden_states"]] for o in outputs[n]] for n in seqs_by_case}
    if getattr(args, "save_tensors", None):  # raw material for measuring the row-error distribution
        torch.save({"layer_ids": ids, "sequences": seqs_by_case,
                    "captured": {n: [[h.cpu() for h in c] for c in cs] for n, cs in captured.items()},
                    "references": {r: {n: [[h.cpu() for h in c] for c in cs] for n, cs in ref.items()}
                                   for r, ref in references.items()},
                    "margins": ref_margins}, args.save_tensors)
    result["references"] = {}
    for ref_name, ref in references.items():
        result["references"][ref_name] = {}
        for name in seqs_by_case:
            mg = ref_margins.get(ref_name, {}).get(name)
            if mg is not None and not any(mg):  # a dense model: no router, no near-tie pass
                mg = None
            sp = spreads.get(ref_name, {}).get(name) if mg is None else None
            rep = compare(captured[name], ref[name], dtype=captured_dtype, margins=mg, layer_ids=ids,
                          token_ids=seqs_by_case[name] if mg is not None else None, spread=sp)
            worst = rep.worst_row
            if worst is not None:  # name the layer, not its index in the compared list
                worst = {"sequence": worst["sequence"], "layer": ids[worst["layer_index"]],
                         "row": worst["row"], "error": worst["error"]}
            result["references"][ref_name][name] = {
                "max_error": rep.max_error, "passed": rep.passed, "summary": rep.summary(),
                "row_tolerance": rep.row_tolerance, "worst_row": worst,
                "rows_over_row_tolerance": sum(n for r in rep.rows_over for n in r if n > 0),
                "row_quantiles": rep.row_quantiles,
                "max_row_error": worst["error"] if worst else None,
                "massive_rows": rep.massive_rows, "spread_allowed": rep.spread_allowed,
            }
            if rep.margin_tie is not None:  # router near-ties of this reference (issue #14)
                keys = ("sequence", "layer", "row", "error", "margin", "margin_layer")
                result["references"][ref_name][name].update({
                    "margin_tie": rep.margin_tie,
                    "margin_quantiles": rep.margin_quantiles,
                    "rows_explained": len(rep.explained),
                    "rows_unexplained": len(rep.unexplained),
                    "max_error_unexplained": max((e for r in rep.errors_unexplained for e in r), default=0.0),
                    "explained_rows_fields": list(keys),
                    "explained_rows": [[x[k] for k in keys] for x in rep.explained],
                    "unexplained_rows": [{k: _finite(x[k]) for k in keys + ("norm_ratio", "nearest_other_row", "why")}
                                         for x in rep.unexplained],
                })
    if controls:
        result["negative_controls"] = {
            c: {name: _control_report(captured[name], ref[name], seqs_by_case[name], l4s, captured_dtype)
                for name in seqs_by_case}
            for c, ref in controls.items()
        }


def _case_verdicts(result: dict, outputs: dict, batches: dict, seqs_by_case, ids, captured_dtype, primary: str) -> None:
    """Each case's verdict (shapes, tokens, the primary reference's errors), the repeat call's
    bit-identity, and ``result["passed"]``."""

    for name, seqs in seqs_by_case.items():
        out = outputs[name]
        case = result["cases"][name]
        case["lengths_in"] = [len(s) for s in batches[name]]
        case["lengths_out"] = [int(o["input_ids"].shape[0]) for o in out]
        case["lengths_expected"] = [len(s) for s in seqs]
        case["shapes_ok"] = len(out) == len(seqs) and all(
            len(o["hidden_states"]) == len(ids)
            and all(tuple(h.shape) == (len(s), o["hidden_states"][0].shape[-1]) for h in o["hidden_states"])
            and o["input_ids"].tolist() == s
            for o, s in zip(out, seqs)
        )
        verdict = result["references"].get(primary, {}).get(name)
        case["reference"] = primary
        case["max_error"] = verdict["max_error"] if verdict else None
        case["max_row_error"] = verdict.get("max_row_error") if verdict else None
        case["tolerance"] = reference_tolerance(captured_dtype)
        case["row_tolerance"] = verdict.get("row_tolerance") if verdict else None
        case["worst_row"] = verdict.get("worst_row") if verdict else None
        case["rows_over_row_tolerance"] = verdict.get("rows_over_row_tolerance") if verdict else None
        case["row_quantiles"] = verdict.get("row_quantiles") if verdict else None
        case["massive_rows"] = verdict.get("massive_rows") if verdict else None
        case["spread_allowed"] = verdict.get("spread_allowed") if verdict else None
        for key in ("margin_tie", "rows_explained", "rows_unexplained", "max_error_unexplained"):
            if verdict and key in verdict:
                case[key] = verdict[key]
        case["passed"] = bool(verdict and verdict["passed"]) and case["shapes_ok"]
        case["summary"] = verdict["summary"] if verdict else f"no {primary} reference: {result.get('vllm_reference')}"
        case["tokens_per_s"] = case["tokens"] / case["seconds"] if case["seconds"] else None
    result["cases"]["repeat"] = {
        "identical": len(outputs["mixed"]) == len(outputs["repeat"]) and all(
            len(x["hidden_states"]) == len(y["hidden_states"])
            and all(a.shape == b.shape and a.dtype == b.dtype and bool(same_bits(a.cpu(), b.cpu()).all())
                    for a, b in zip(x["hidden_states"], y["hidden_states"]))
            for x, y in zip(outputs["mixed"], outputs["repeat"])
        )
    }
    result["passed"] = all(result["cases"][n]["passed"] for n in ("mixed", "chunked", "truncated")) and result["cases"][
        "repeat"
    ]["identical"]


def same_bits(a, b):
    """Per row of two same-shape, same-dtype tensors: whether every bit is equal (NaN == NaN)."""
    import torch

    if a.numel() == 0:
        return torch.ones(a.shape[0], dtype=torch.bool)
    n = a.shape[0]
    return (a.contiguous().view(torch.uint8).view(n, -1) == b.contiguous().view(torch.uint8).view(n, -1)).all(dim=-1)


_SCHEDULE_KEYS = ("max_num_batched_tokens", "max_num_seqs", "long_prefill_token_threshold", "enable_chunked_prefill",
                  "max_num_partial_prefills", "max_long_partial_prefills")


def _settle(args, result, outputs, model_dir, dtype, layer_ids, seqs_by_case, platform, versions) -> dict:
    """Every case's rows against vLLM's own forward with the shim off, scheduled as the generator
    scheduled them (its token budget, max sequences, block size and KV blocks; ``vllm_reference`` "schedule":
    "generator") and with its custom-op choice (on CPU engine-options turns vLLM's rotary op off).
    ``settled``: every row of every case bit-identical and the repeat call identical: what the
    reference disagrees with is the engine's own computation, not the capture."""
    import torch

    schedule = dict(result.get("scheduler") or {})
    engine = result.get("engine") or {}
    if isinstance(engine.get("block_size"), int):  # the KV layout chunked prefill reads back
        schedule["block_size"] = engine["block_size"]
    if isinstance(engine.get("num_gpu_blocks"), int) and platform == "cpu":
        # CPU: each engine has its own VLLM_CPU_KVCACHE_SPACE; on a GPU the generator's engine may
        # still hold its memory, and its KV cache rarely bounds a step there
        schedule["num_gpu_blocks_override"] = engine["num_gpu_blocks"]
    if engine.get("custom_ops") is not None:
        schedule["compilation_config"] = {"custom_ops": engine["custom_ops"]}
    try:
        got = _vllm_reference(args, model_dir, dtype, layer_ids, seqs_by_case, ["own"], platform, versions,
                              schedule=schedule)
    except Exception as exc:  # noqa: BLE001 - recorded: nothing settled
        return {"settled": False, "error": f"{type(exc).__name__}: {exc}"[-4000:]}
    cases = {}
    for name in seqs_by_case:
        ref = got["variants"]["own"][name]
        first = None  # the first row (in sequence, layer, row order) that differs
        by_layer: dict = {}  # layer -> [rows bit-identical, rows]
        non_finite = 0  # the generator's rows holding a NaN or inf, identical to the reference's or not
        for s_i, (out, want) in enumerate(zip(outputs[name], ref)):
            for l_i, (a, b) in enumerate(zip(out["hidden_states"], want)):
                counts = by_layer.setdefault(layer_ids[l_i], [0, 0])
                if a.shape != b.shape:
                    counts[1] += max(a.shape[0], b.shape[0])
                    first = first or {"sequence": s_i, "layer": layer_ids[l_i],
                                      "error": f"shape {tuple(a.shape)} vs {tuple(b.shape)}"}
                    continue
                a, b = a.cpu(), b.to(a.dtype).cpu()
                eq = same_bits(a, b)  # bits, not values: a NaN the engine computed itself is identical too
                non_finite += int((~torch.isfinite(a.float())).any(dim=-1).sum()) if a.numel() else 0
                counts[0] += int(eq.sum())
                counts[1] += int(eq.numel())
                if first is None and not bool(eq.all()):
                    r = int((~eq).nonzero()[0])
                    err = float((a[r].float() - b[r].float()).norm() / b[r].float().norm().clamp_min(1e-30))
                    first = {"sequence": s_i, "layer": layer_ids[l_i], "row": r, "error": err}
        cases[name] = {"rows": sum(c[1] for c in by_layer.values()), "identical": sum(c[0] for c in by_layer.values()),
                       "identical_per_layer": by_layer, "first_differing": first, "non_finite_rows": non_finite,
                       "sequences": len(outputs[name]) == len(ref)}
    ok = all(c["rows"] and c["rows"] == c["identical"] and c["sequences"] for c in cases.values())
    mine = result.get("generator_schedule") or {}
    theirs = got.get("schedule") or {}
    differ = {name: [i for i, (a, b) in enumerate(zip(mine[name], theirs[name])) if [list(x) for x in a] != [list(x) for x in b]]
              for name in seqs_by_case if name in mine and name in theirs}
    return {"settled": ok and bool(result["cases"]["repeat"]["identical"]), "cases": cases,
            "schedule_differs": {k: v for k, v in differ.items() if v},  # sequences split otherwise than the generator
            "schedule": got.get("schedule"), "init_s": got.get("init_s"), "seconds": got.get("seconds"),
            "reference": "vLLM's own forward, shim off, scheduled as the generator"}


def _finite(v):
    """JSON has no inf/NaN: those become None (a margin of inf: no MoE layer at or before)."""
    return None if isinstance(v, float) and not math.isfinite(v) else v


def reference_tolerance(dtype) -> float:
    from speculators_compat_testbed.reference import TOLERANCE, _dtype_name

    return TOLERANCE[_dtype_name(dtype)]


def _control_report(captured, reference, seqs, l4s, dtype) -> dict:
    """How far the capture is from a negative control (a reference that must differ).

    Per token: relative error of its row. With llama_4_scaling, tokens at positions below
    ``original_max_position_embeddings`` get factor 1 (and attend only to such tokens), so they
    must agree; every later token must differ."""
    import torch

    from speculators_compat_testbed.reference import _row_errors, compare

    tol = reference_tolerance(dtype)
    rep = compare(captured, reference, dtype=dtype)
    n0 = int(l4s["original_max_position_embeddings"]) if l4s else 0
    early, late = [], []
    for cap, ref in zip(captured, reference):
        for c, r in zip(cap, ref):
            rows = _row_errors(c, r)
            early.append(rows[:n0])
            late.append(rows[n0:])
    early_t = torch.cat(early) if early else torch.zeros(0)
    late_t = torch.cat(late) if late else torch.zeros(0)
    return {
        "max_error": rep.max_error,
        "min_error": min((e for row in rep.errors for e in row), default=0.0),
        "passed_as_reference": rep.passed,  # must be False for the control to mean anything
        "entries_over_tolerance": f"{len(rep.failures())}/{sum(len(row) for row in rep.errors)}",
        # rows = (token, captured layer) pairs; "scaled": positions with a factor != 1
        "rows_scaled": int(late_t.numel()),
        "rows_scaled_over_tolerance": int((late_t > tol).sum()),
        "min_row_error_scaled": float(late_t.min()) if late_t.numel() else None,
        "median_row_error_scaled": float(late_t.median()) if late_t.numel() else None,
        "rows_unscaled": int(early_t.numel()),
        "max_row_error_unscaled": float(early_t.max()) if early_t.numel() else None,
    }


def _has_vision_tower(model_dir) -> bool:
    """True where the model's config.json has a vision config (a multimodal wrapper)."""
    from .rehearsal import CannotRehearse, read_config

    try:
        return "vision_config" in read_config(model_dir)[0]
    except CannotRehearse:
        return False


def _vllm_reference(args, model_dir, dtype, layer_ids, seqs_by_case, variants, platform, versions, schedule=None) -> dict:
    """Run testing.vllm_reference in a subprocess with the shim disabled; its result dict."""
    import subprocess
    import tempfile

    import torch

    from speculators_compat_testbed import tiny_models

    spec = {
        "model_dir": str(model_dir),
        "arch": args.arch,
        "dtype": str(dtype).replace("torch.", ""),
        "max_model_len": args.max_model_len,
        "layer_ids": list(layer_ids),
        "batches": seqs_by_case,
        "variants": variants,
        "engine_kwargs": tiny_models.vllm_engine_kwargs(args.arch, platform),
    }
    if schedule is not None:  # the generator's scheduler settings, so the engine batches as it did
        from vllm.engine.arg_utils import EngineArgs

        spec["schedule"] = "generator"
        known = set(getattr(EngineArgs, "__dataclass_fields__", {}))
        spec["engine_kwargs"].update({k: v for k, v in schedule.items() if k in known})
        spec["engine_kwargs"].setdefault("distributed_executor_backend", "mp")  # see the env below
        if args.tensor_parallel_size != 1:
            spec["engine_kwargs"]["tensor_parallel_size"] = args.tensor_parallel_size
    if _has_vision_tower(model_dir):  # text-only prompts: no dummy image in vLLM's start-up profile
        from vllm.engine.arg_utils import EngineArgs

        if "limit_mm_per_prompt" in getattr(EngineArgs, "__dataclass_fields__", {}):
            spec["engine_kwargs"].setdefault("limit_mm_per_prompt", {"image": 0, "video": 0})
    from speculators_compat.patches.engine_options import additional_config

    extra = additional_config()  # the generator's engine got it (SPECULATORS_COMPAT_ADDITIONAL_CONFIG)
    if extra:
        spec["engine_kwargs"]["additional_config"] = {**spec["engine_kwargs"].get("additional_config", {}), **extra}
    if platform == "cuda":  # the same device budget and attention backend as the generator's engine
        spec["engine_kwargs"].setdefault("gpu_memory_utilization", args.gpu_memory_utilization or 0.15)
        backend = os.environ.get("SPECULATORS_COMPAT_ATTENTION_BACKEND")
        if backend:
            spec["engine_kwargs"].setdefault("attention_config", {"backend": backend})
    with tempfile.TemporaryDirectory(prefix="spec-compat-vllm-ref-") as td:
        src, dst = os.path.join(td, "in.pt"), os.path.join(td, "out.pt")
        torch.save(spec, src)
        env = dict(os.environ, SPECULATORS_COMPAT_DISABLE="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
        if schedule is not None:  # the engine core in this process, so every prompt is queued before its
            # first step (a busy core process starts on the first alone); the model in a worker process
            # of vLLM's MultiprocExecutor, as the generator's (CPU kernels split work by the worker's threads)
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        proc = subprocess.run(
            [sys.executable, "-m", "speculators_compat_testbed.vllm_reference", src, dst],
            env=env, capture_output=True, text=True, timeout=args.reference_timeout,
        )
        if proc.returncode != 0 or not os.path.exists(dst):
            tail = (proc.stdout[-2000:] + "\n" + proc.stderr[-4000:]).strip()
            raise RuntimeError(f"vllm_reference exited {proc.returncode}: {tail}")
        return torch.load(dst, weights_only=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--model-dir", default=None,
                        help="run this checkpoint instead of building a tiny one (--arch then names the "
                        "test-bed family whose engine environment applies)")
    parser.add_argument("--out", default=None, help="write the JSON result here (default: stdout)")
    parser.add_argument("--unpatched", action="store_true", help="disable the shim in every process")
    parser.add_argument("--layers", default=None)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the generator's token budget per step (speculators' default: max(8192, max_model_len)); "
        "below the sequence lengths every long sequence is prefilled in chunks over several steps",
    )
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
    parser.add_argument(
        "--quantization",
        default=None,
        choices=("w4a16",),
        help="kimi_k25 only: INT4 as released (compressed-tensors pack-quantized W4A16, group 32, routed experts); "
        "the engine loads the packed checkpoint, HF its dequantized copy",
    )
    parser.add_argument(
        "--reference",
        default="hf",
        choices=("hf", "vllm"),
        help="what decides the cell: HF transformers (default; HF + the harness's llama_4_scaling when the "
        "config sets it and HF does not implement it) or the same vLLM engine's own forward with the shim "
        "disabled (testing.vllm_reference); the other comparisons are recorded under 'references'",
    )
    parser.add_argument(
        "--save-tensors", default=None, help="also torch.save the captures and references here (for analysis)"
    )
    parser.add_argument(
        "--settle", nargs="?", const="on-fail", choices=("on-fail", "always"), default=None,
        help="where the reference disagrees (or always), compare every row with the same engine's own forward "
        "(shim off) scheduled as the generator scheduled it; bit-identical everywhere is recorded as 'settled'",
    )
    parser.add_argument(
        "--plant", default=None, choices=("order", "shift", "no_residual", "early"),
        help="negative control: a wrong answer planted in the workers' capture (fault_runner._arm_plant) "
        "before the first call; with SPECULATORS_COMPAT_SELF_CHECK_ROWS=0 it reaches the comparisons",
    )
    parser.add_argument("--reference-timeout", type=int, default=1200, help="seconds for the vLLM reference run")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    result = run(args)
    from speculators_compat_testbed.provenance import scrub_paths

    text = json.dumps(scrub_paths(json.loads(json.dumps(result, default=str))), indent=2)
    if args.out:  # whole or not at all: a run killed mid-write leaves the previous result
        tmp = f"{args.out}.partial"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, args.out)
    else:
        print(text)
    sys.stdout.flush()
    # exit at once: engine/worker teardown in interpreter shutdown can hang on some versions
    os._exit(0)


if __name__ == "__main__":
    main()
