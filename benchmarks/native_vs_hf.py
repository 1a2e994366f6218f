"""vLLM's own engine (no speculators, shim disabled) against HF transformers on a tiny model.

Answers "is vLLM itself wrong here?" without the generator: ``vllm.LLM`` computes prompt
logprobs for a few prompts, HF computes log-softmax logits on the same weights, and the script
reports the largest |logprob difference| per prompt position, plus greedy next-token agreement.
One engine per process (CPU: one engine at a time); run it once per ``--custom-ops`` setting.

    SPECULATORS_COMPAT_DISABLE=1 VLLM_CPU_KVCACHE_SPACE=1 $PY benchmarks/native_vs_hf.py \
        --model-dir DIR --dtype float32 --custom-ops="-rms_norm" --out result.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time


def _prompts(vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(7)
    lengths = (7, 33, 120)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]


def _hf_logprobs(model_dir: str, dtype: str, prompts: list[list[int]]):
    import torch

    from speculators_compat_testbed.reference import load_hf_model

    model = load_hf_model(model_dir, dtype)
    out = []
    with torch.no_grad():
        for ids in prompts:
            logits = model(torch.tensor([ids])).logits[0].float()
            out.append(torch.log_softmax(logits, dim=-1))
    return out


def _vllm_logprobs(model_dir: str, dtype: str, custom_ops: list[str], enforce_eager: bool, prompts):
    from vllm import LLM, SamplingParams

    kwargs = {}
    if custom_ops:
        kwargs["compilation_config"] = {"custom_ops": list(custom_ops)}
    t0 = time.perf_counter()
    llm = LLM(
        model=model_dir,
        dtype=dtype,
        enforce_eager=enforce_eager,
        max_model_len=512,
        enable_prefix_caching=False,
        **kwargs,
    )
    init_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
    effective = list(llm.llm_engine.vllm_config.compilation_config.custom_ops)
    result = []
    for ids, o in zip(prompts, outs):
        plp = [None] + [d[t].logprob for t, d in zip(ids[1:], o.prompt_logprobs[1:])]
        result.append({"prompt_logprobs": plp, "next_token": o.outputs[0].token_ids[0]})
    return result, effective, init_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--custom-ops", default="", help="comma list for CompilationConfig.custom_ops, e.g. -rms_norm")
    ap.add_argument("--no-enforce-eager", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import json as _json

    import torch
    import transformers
    import vllm

    vocab = _json.loads(open(os.path.join(args.model_dir, "config.json")).read())["vocab_size"]
    prompts = _prompts(vocab)
    custom_ops = [s for s in args.custom_ops.split(",") if s]
    enforce_eager = not args.no_enforce_eager
    got, effective, init_s = _vllm_logprobs(args.model_dir, args.dtype, custom_ops, enforce_eager, prompts)
    ref = _hf_logprobs(args.model_dir, args.dtype, prompts)

    per_prompt = []
    for ids, g, r in zip(prompts, got, ref):
        diffs = [abs(g["prompt_logprobs"][i] - r[i - 1, ids[i]].item()) for i in range(1, len(ids))]
        hf_next = int(r[-1].argmax())
        per_prompt.append({
            "length": len(ids),
            "max_abs_logprob_diff": max(diffs),
            "abs_logprob_diff_from_position_0": diffs[0],  # token 1 scored by position 0's logits
            "positions_over_1e-2": sum(d > 1e-2 for d in diffs),
            "positions_scored": len(diffs),
            "next_token_vllm": g["next_token"],
            "next_token_hf": hf_next,
        })
    record = {
        "what": "vllm.LLM prompt logprobs vs HF transformers log-softmax, same tiny checkpoint, no speculators",
        "model_dir": os.path.basename(os.path.normpath(args.model_dir)),
        "dtype": args.dtype,
        "enforce_eager": enforce_eager,
        "custom_ops_requested": custom_ops,
        "custom_ops_effective": effective,
        "shim_disabled": os.environ.get("SPECULATORS_COMPAT_DISABLE") == "1",
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
        "machine": platform.machine(),
        "engine_init_s": round(init_s, 1),
        "max_abs_logprob_diff": max(p["max_abs_logprob_diff"] for p in per_prompt),
        "prompts": per_prompt,
    }
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
    print(json.dumps({k: record[k] for k in ("versions", "custom_ops_effective", "max_abs_logprob_diff")}))


if __name__ == "__main__":
    main()
