"""Plot extraction throughput vs prompt length, shim vs native, from throughput.py's JSONs.

    python benchmarks/plot_throughput.py --out benchmarks/results/throughput.png \\
        benchmarks/results/gpu/throughput_h200.json benchmarks/results/gpu/throughput_h200_native_noasync.json \\
        benchmarks/results/gpu/throughput_h200_shim_pipeline0.json [benchmarks/results/cpu/throughput_cpu_vllm-0.16.json]

One panel per platform (GPU / CPU); per input file a native line (labelled with its async
scheduling setting) and the shim line (median tok/s, with min–max bars over repetitions).
Also prints the numbers as a markdown table (what the README shows next to the plot).
"""

from __future__ import annotations

import argparse
import json
import statistics


def _series(rows, key):
    xs, med, lo, hi = [], [], [], []
    for r in rows:
        vals = r.get(key)
        if not vals:
            continue
        xs.append(r["prompt_len"])
        med.append(statistics.median(vals) / 1000)
        lo.append(min(vals) / 1000)
        hi.append(max(vals) / 1000)
    return xs, med, lo, hi


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("inputs", nargs="+")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.load(open(path)) | {"_path": path} for path in args.inputs]
    platforms = sorted({r["platform"] for r in runs}, key=lambda p: p != "cuda")
    fig, axes = plt.subplots(1, len(platforms), figsize=(6.5 * len(platforms), 4.5), squeeze=False)
    table = ["| platform | prompt length | compared with | shim driver | shim tok/s | other tok/s | ratio median (min–max) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for ax, plat in zip(axes[0], platforms):
        shim_drawn = False
        for run in [r for r in runs if r["platform"] == plat]:
            setting = run.get("native_async_scheduling", "default")
            native_label = "vLLM LLM.generate, max_tokens=1" + ("" if setting == "default" else ", async scheduling off")
            xs, med, lo, hi = _series(run["rows"], "native_tok_s")
            if xs:
                ax.errorbar(xs, med, yerr=[[m - a for m, a in zip(med, lo)], [b - m for m, b in zip(med, hi)]],
                            marker="s", capsize=3, linestyle="--", label=native_label)
            xs, med, lo, hi = _series(run["rows"], "vllm_extract_tok_s")
            if xs:
                ax.errorbar(xs, med, yerr=[[m - a for m, a in zip(med, lo)], [b - m for m, b in zip(med, hi)]],
                            marker="^", capsize=3, linestyle=":", label="vLLM's own extract_hidden_states (+ load)")
            shim_only = not any("native_tok_s" in r for r in run["rows"])
            if not shim_drawn or shim_only:
                driver = run["rows"][0].get("driver") or "serial"
                xs, med, lo, hi = _series(run["rows"], "shim_tok_s")
                ax.errorbar(xs, med, yerr=[[m - a for m, a in zip(med, lo)], [b - m for m, b in zip(med, hi)]],
                            marker="o", capsize=3, linewidth=2 if not shim_only else 1, alpha=1 if not shim_only else 0.6,
                            label=f"speculators generator + speculators-compat ({driver} driver)")
                shim_drawn = shim_drawn or not shim_only
            for r in run["rows"]:
                if "ratio_vs_vllm_extract_median" in r:
                    table.append(
                        f"| {run['device']} | {r['prompt_len']} | vLLM extract_hidden_states | {r.get('driver') or 'serial'} | {r['shim_median_tok_s'] / 1000:.1f}k "
                        f"| {r['vllm_extract_median_tok_s'] / 1000:.1f}k | {r['ratio_vs_vllm_extract_median']:.2f} "
                        f"({r['ratio_vs_vllm_extract_min']:.2f}–{r['ratio_vs_vllm_extract_max']:.2f}) |"
                    )
                if "ratio_median" in r:
                    table.append(
                        f"| {run['device']} | {r['prompt_len']} | vLLM LLM, "
                        f"{('async scheduling on (default)' if plat == 'cuda' else 'default engine (no async scheduling on CPU)') if setting == 'default' else 'async scheduling ' + setting} "
                        f"| {r.get('driver') or 'serial'} | {r['shim_median_tok_s'] / 1000:.1f}k "
                        f"| {r['native_median_tok_s'] / 1000:.1f}k | {r['ratio_median']:.2f} ({r['ratio_min']:.2f}–{r['ratio_max']:.2f}) |"
                    )
        first = [r for r in runs if r["platform"] == plat][0]
        ax.set_title(f"{first['device']} — vLLM {first['versions'].get('vllm')}, "
                     f"Llama h{first['model']['hidden']}×{first['model']['layers']}L, batch {first['rows'][0]['batch']}")
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("prefill tokens/s (thousands)")
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["prompt_len"] for r in first["rows"]])
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
