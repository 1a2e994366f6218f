"""HF's own bf16-vs-fp32 spread on the e2e runner's tokens: the yardstick for bf16-only cells.

Where vLLM can run an arch in bf16 only (CPU gated delta-net: Qwen3.5, Qwen3-Next), the e2e cell
compares vLLM bf16 with HF bf16. This script measures how far HF bf16 is from HF fp32 on the very
sequences the runner draws (same seed, same lengths, same captured layers), per row
(``||bf16_i - fp32_i|| / ||fp32_i||``), so a cell's worst row can be read against it::

    python scripts/hf_dtype_spread.py --arch qwen3_5 --out spread.json

No vLLM needed (transformers + torch).
"""

from __future__ import annotations

import argparse
import json
import random


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--layers", default=None, help="captured layer ids (default: speculators' auto choice)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoConfig, AutoTokenizer

    from speculators_compat_testbed import tiny_models
    from speculators_compat_testbed.e2e_runner import _lengths_chunked, _lengths_mixed, _sequences
    from speculators_compat_testbed.reference import _row_errors, hf_layer_outputs, load_hf_model

    model_dir = tiny_models.build_tiny_model(args.arch)
    n = AutoConfig.from_pretrained(model_dir).num_hidden_layers
    layer_ids = [int(x) for x in args.layers.split(",")] if args.layers else [2, n // 2, n - 3, n - 1]
    ids = sorted(layer_ids)
    tok = AutoTokenizer.from_pretrained(model_dir)
    vocab = min(getattr(tok, "vocab_size", 1000), 1000)
    rng = random.Random(args.seed)  # drawn in the runner's order
    batches = {
        "mixed": _sequences(_lengths_mixed(), rng, vocab),
        "chunked": _sequences(_lengths_chunked(rng), rng, vocab),
        "truncated": _sequences([args.max_model_len + 50, 12], rng, vocab),
    }
    batches["truncated"] = [s[: args.max_model_len - 1] for s in batches["truncated"]]
    models = {d: load_hf_model(model_dir, dtype=d) for d in ("float32", "bfloat16")}
    from speculators_compat_testbed.provenance import provenance

    out: dict = {"provenance": provenance(), "arch": args.arch, "model_dir": model_dir.name, "layer_ids": ids,
                 "seed": args.seed, "cases": {}}
    for name, seqs in batches.items():
        ref = hf_layer_outputs(models["float32"], seqs, ids, dtype="float32")
        low = hf_layer_outputs(models["bfloat16"], seqs, ids, dtype="bfloat16")
        rows = torch.cat([_row_errors(b, a) for sa, sb in zip(ref, low) for a, b in zip(sa, sb)])
        q = torch.quantile(rows, torch.tensor([0.5, 0.99, 0.999]))
        out["cases"][name] = {
            "rows": int(rows.numel()),
            "p50": float(q[0]),
            "p99": float(q[1]),
            "p99.9": float(q[2]),
            "max": float(rows.max()),
        }
        print(name, json.dumps(out["cases"][name]))
    text = json.dumps(out, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
