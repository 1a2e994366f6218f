"""Which CUDA vLLM releases pair with the H200 image's torch, and which of them are verified there.

For every vLLM release from --first to --last (PyPI's release list), pip resolves the CUDA wheel
for CPython 3.12 on manylinux x86_64 without installing it (`--dry-run --report`, metadata only)
and the wheel's own `Requires-Dist: torch` pin is recorded. `run_on_the_h200` is read from the
tested table's rule (scripts/update_tested.py, imported): the CUDA row of that release is "verified"
(clean results of HEAD's src tree, llama and qwen3 passing); `tested_status` keeps what the table says
otherwise (stale, broken), and `pair_but_not_verified` lists the pairing releases without a verified row.

    python3 scripts/cuda_torch_pins.py [--image-torch 2.11.0] [--out benchmarks/results/gpu/cuda_wheel_torch_pins.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(1, str(ROOT / "testbed"))
sys.path.insert(0, str(ROOT / "scripts"))

import update_tested as ut  # noqa: E402 - the tested table's rule and version order
from speculators_compat_testbed.provenance import provenance  # noqa: E402

PLATFORMS = ["manylinux_2_35_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]


def releases(first: str, last: str) -> list[str]:
    with urllib.request.urlopen("https://pypi.org/pypi/vllm/json", timeout=60) as r:
        data = json.load(r)
    out = []
    for v, files in data["releases"].items():
        if not all(p.isdigit() for p in v.split(".")):
            continue  # pre-releases, post/dev tags
        if not any(f["filename"].endswith(".whl") and not f.get("yanked") for f in files):
            continue
        if ut._vkey(first) <= ut._vkey(v) <= ut._vkey(last):
            out.append(v)
    return sorted(out, key=ut._vkey)


def wheel_pin(version: str) -> tuple[str, list[str]]:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "R.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed",
               "--quiet", "--report", str(report), "--only-binary=:all:", "--python-version", "3.12",
               "--implementation", "cp"]
        for p in PLATFORMS:
            cmd += ["--platform", p]
        cmd += ["--target", str(Path(tmp) / "T"), f"vllm=={version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"pip could not resolve vllm=={version}: {proc.stderr.strip()[-400:]}")
        item = json.loads(report.read_text())["install"][0]
    wheel = item["download_info"]["url"].rsplit("/", 1)[-1]
    pins = [r.split(";")[0].replace(" ", "") for r in item["metadata"].get("requires_dist", [])
            if r.split(";")[0].strip().startswith("torch") and r.split(";")[0].strip()[5:6] in "=<>!~ "]
    return wheel, pins


def verified_on_h200() -> dict[str, str]:
    """vLLM release -> the tested table's status for CUDA rows, by scripts/update_tested.py's own
    rule (clean results of HEAD's src tree, every llama/qwen3 cell passing for the pair): a release
    counts as run when that status is "verified" for a speculators release."""
    rows = ut.rows_from(ut.group(ut.load_cells()), ut.head_src_tree())
    out: dict[str, str] = {}
    for r in rows:
        if r.get("platform") == "cuda":
            prev = out.get(r["vllm"])
            out[r["vllm"]] = "verified" if "verified" in (prev, r["status"]) else r["status"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--first", default="0.19.1")
    ap.add_argument("--last", default="0.33.0")
    ap.add_argument("--image-torch", default="2.11.0")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/gpu/cuda_wheel_torch_pins.json"))
    a = ap.parse_args()
    prov = provenance()
    status = verified_on_h200()
    rows = []
    for v in releases(a.first, a.last):
        wheel, pins = wheel_pin(v)
        pairs = f"torch=={a.image_torch}" in pins
        rows.append({"vllm": v, "wheel": wheel, "torch_pin": pins, "pairs_with_the_h200_image": pairs,
                     "run_on_the_h200": status.get(v) == "verified", "tested_status": status.get(v)})
        print(f"{v:8} {wheel:55} {','.join(pins):18} pairs={pairs} status={status.get(v)}")
    out = {"provenance": prov,
           "what": (f"the torch each CUDA vLLM wheel pins (its own metadata, read by pip from the package "
                    f"index), {a.first}-{a.last} (every release in that range); run_on_the_h200: the tested "
                    f"table's CUDA row of that release is verified at this src tree (update_tested's rule); "
                    f"the H200 image has torch {a.image_torch}"),
           "image_torch": a.image_torch,
           "rows": rows,
           "pair_but_not_verified": [r["vllm"] for r in rows if r["pairs_with_the_h200_image"] and not r["run_on_the_h200"]]}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"pair but not verified: {out['pair_but_not_verified'] or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
