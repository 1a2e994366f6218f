"""tok/s against prompt length from committed throughput JSONs, as an SVG (no plotting library).

Each input is one ``benchmarks/throughput.py`` result (``--capture-control``: the shim capturing
its layers, and the shim capturing one layer, alternating). One line per (file, side): the median
tok/s over its repetitions, the min-max range as a band. The figure's caption names each file's
src tree, shape and batch, so a stale file reads as stale.

    python benchmarks/plot_prompt_lengths.py benchmarks/results/gpu/throughput_h200_h4096_capture_b64.json \\
        --out benchmarks/results/gpu/tok_s_vs_prompt_len.svg
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

W, H, LEFT, RIGHT, TOP, BOTTOM = 760, 440, 80, 220, 30, 110
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
SIDES = (("shim_tok_s", "shim, {n} layers"), ("shim_1layer_tok_s", "shim, 1 layer"), ("native_tok_s", "native vLLM"))


def series(path: Path) -> tuple[list[dict], str]:
    d = json.loads(path.read_text())
    m, prov = d.get("model", {}), d.get("provenance", {})
    batch = sorted({r.get("batch") for r in d["rows"]})
    caption = (f"{path.name}: hidden {m.get('hidden')} x {m.get('layers')} layers, batch {batch}, "
               f"{d.get('device')}, src tree {str(prov.get('src_tree'))[:7]}, {str(prov.get('date_utc'))[:10]}")
    out = []
    for key, label in SIDES:
        pts = [(r["prompt_len"], sorted(r[key])) for r in d["rows"] if r.get(key)]
        if pts:
            n = len(m.get("captured") or []) or "N"
            out.append({"label": f"{label.format(n=n)} (b{batch[0]})", "points": pts})
    return out, caption


def svg(lines: list[dict], captions: list[str], title: str) -> str:
    xs = sorted({x for s in lines for x, _ in s["points"]})
    ys = [v for s in lines for _, vals in s["points"] for v in vals]
    x0, x1 = math.log2(xs[0]), math.log2(xs[-1]) if xs[-1] > xs[0] else math.log2(xs[0]) + 1
    y0, y1 = 0.0, max(ys) * 1.08
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM

    def px(x):
        return LEFT + (math.log2(x) - x0) / (x1 - x0) * pw

    def py(y):
        return TOP + ph - (y - y0) / (y1 - y0) * ph

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
           f'<text x="{LEFT}" y="18" font-size="13">{title}</text>',
           f'<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>']
    step = 10 ** math.floor(math.log10(y1 / 4))
    step *= 5 if y1 / step > 20 else 2 if y1 / step > 8 else 1
    y = 0.0
    while y <= y1:
        out.append(f'<line x1="{LEFT}" x2="{LEFT + pw}" y1="{py(y):.1f}" y2="{py(y):.1f}" stroke="#eee"/>')
        out.append(f'<text x="{LEFT - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y / 1000:.0f}k</text>')
        y += step
    for x in xs:
        out.append(f'<text x="{px(x):.1f}" y="{TOP + ph + 16}" text-anchor="middle">{x}</text>')
    out.append(f'<text x="{LEFT + pw / 2}" y="{TOP + ph + 32}" text-anchor="middle">prompt length (tokens)</text>')
    out.append(f'<text x="16" y="{TOP + ph / 2}" transform="rotate(-90 16 {TOP + ph / 2})" '
               'text-anchor="middle">tokens / s (median; band: min-max)</text>')
    for i, s in enumerate(lines):
        c = COLORS[i % len(COLORS)]
        pts = s["points"]
        band = [(px(x), py(v[-1])) for x, v in pts] + [(px(x), py(v[0])) for x, v in reversed(pts)]
        out.append('<polygon fill="{}" fill-opacity="0.15" points="{}"/>'.format(
            c, " ".join(f"{a:.1f},{b:.1f}" for a, b in band)))
        med = [(px(x), py(v[len(v) // 2])) for x, v in pts]
        out.append('<polyline fill="none" stroke="{}" stroke-width="2" points="{}"/>'.format(
            c, " ".join(f"{a:.1f},{b:.1f}" for a, b in med)))
        for a, b in med:
            out.append(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3" fill="{c}"/>')
        ly = TOP + 14 + 18 * i
        out.append(f'<line x1="{LEFT + pw + 12}" x2="{LEFT + pw + 30}" y1="{ly}" y2="{ly}" stroke="{c}" stroke-width="2"/>')
        out.append(f'<text x="{LEFT + pw + 34}" y="{ly + 4}">{s["label"]}</text>')
    for i, cap in enumerate(captions):
        out.append(f'<text x="10" y="{TOP + ph + 54 + 14 * i}" font-size="10" fill="#555">{cap}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="Capture throughput against prompt length (H200)")
    args = ap.parse_args()
    lines: list[dict] = []
    captions = []
    for f in args.results:
        s, cap = series(Path(f))
        for line in s:  # one line per label: files of one shape and batch at other lengths join it
            same = next((x for x in lines if x["label"] == line["label"]), None)
            if same is None:
                lines.append(line)
            else:
                same["points"] = sorted(same["points"] + line["points"])
        captions.append(cap)
    Path(args.out).write_text(svg(lines, captions, args.title))
    print(f"wrote {args.out}: {len(lines)} line(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
