"""Negative control that bites where it matters: the vLLM-internals patches off, the rest on.

The plain unpatched control (``e2e_runner --unpatched``) often dies at ``import speculators``
(transformers 5) or at a CPU device query: artefacts of the platform, not evidence that the
patches of vLLM's internals are needed. This control keeps the import, platform, executor and
speculators-script patches and leaves out every patch of the families that touch vLLM's
internals (config, kv-cache, scheduler-request, execution, layer-calling), then records the
first call from speculators' generator into vLLM that fails.

    python tests/e2e/internals_control.py [--pairs 0.3.0:0.16.0,...] [--out-dir benchmarks/results/controls]

runs the control on every test-bed pair (``noxfile.PAIRS``), writes one JSON per pair (the
runner's result, with its provenance, plus ``call_site``) and ``SUMMARY.md``.
``tests/e2e/test_generator.py::test_internals_off_fails_at_a_vllm_call_site`` runs it on the pair
of the env it runs in.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INTERNALS_FAMILIES = ("config", "kv-cache", "scheduler-request", "execution", "layer-calling")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def selection() -> str:
    """``SPECULATORS_COMPAT_PATCHES`` leaving out every patch of the internals families."""
    from speculators_compat.patches import all_patches

    return ",".join(f"-{p.id}" for p in all_patches() if p.family in INTERNALS_FAMILIES)


def _area(path: str) -> str | None:
    for pkg in ("speculators_compat", "speculators", "vllm"):
        if f"/{pkg}/" in path or path.startswith(f"{pkg}/") or path.startswith(f"src/{pkg}/"):
            return pkg
    return None


def call_site(traceback_text: str) -> dict | None:
    """The first frame of speculators' own code whose next frame is inside vLLM: where
    speculators calls vLLM and it fails (None when the traceback has no such pair). Module-level
    frames (``<module>``: an import) do not count: a failing import is not a call into vLLM."""
    frames = [(m.group(1), int(m.group(2)), m.group(3)) for m in _FRAME.finditer(traceback_text or "")]
    # a call whose arguments do not bind raises at the caller's line, before the callee has a frame:
    # the deepest frame is speculators' and the TypeError names the vLLM callable
    if frames and _area(frames[-1][0]) == "speculators" and frames[-1][2] != "<module>":
        bad_call = _BAD_CALL.search(traceback_text)
        if bad_call:
            path, line, func = frames[-1]
            return {"speculators": f"{_short(path)}:{line} in {func}",
                    "vllm": f"vllm {bad_call.group(1)}() (arguments do not bind: {bad_call.group(2)})"}
    for (path, line, func), nxt in zip(frames, frames[1:]):
        if "<module>" in (func, nxt[2]):
            continue
        if _area(path) != "speculators":
            continue
        here = f"{_short(path)}:{line} in {func}"
        if _area(nxt[0]) == "vllm":
            return {"speculators": here, "vllm": f"{_short(nxt[0])}:{nxt[1]} in {nxt[2]}"}
        # vLLM's config classes are pydantic dataclasses: constructing one with arguments it does
        # not accept fails inside pydantic, and the error names the vLLM class
        validated = _VALIDATION.search(traceback_text)
        if "/pydantic/" in nxt[0] and validated:
            return {"speculators": here, "vllm": f"vllm config class {validated.group(1)} (pydantic validation)"}
    return None


_VALIDATION = re.compile(r"validation errors? for (\w+Config)\b")
_BAD_CALL = re.compile(r"TypeError: ([\w.]+)\(\) (got an unexpected keyword argument '\w+'|missing \d+ required [\w ]+argument)")


def _short(path: str) -> str:
    return path.split("site-packages/", 1)[-1]


def run_control(python: str, out: Path, arch: str = "llama", timeout: int = 1200) -> dict:
    pythonpath = os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT / "testbed"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": pythonpath, "SPECULATORS_COMPAT_PATCHES": selection()}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    out.unlink(missing_ok=True)  # never read an earlier run's result as this one's
    proc = subprocess.run([python, "-m", "speculators_compat_testbed.e2e_runner", "--arch", arch, "--out", str(out)],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=str(out.parent))
    if not out.exists():
        raise RuntimeError(f"runner wrote no result (rc {proc.returncode}): {proc.stderr[-2000:]}")
    result = json.loads(out.read_text())
    err = result.get("error") or {}
    result["control"] = {"what": "vLLM-internals patches off (families: " + ", ".join(INTERNALS_FAMILIES) + "), the rest on",
                         "patches_env": selection(),
                         "call_site": call_site(err.get("traceback", "")),
                         "error": (f"{err.get('type')}: " + next(iter((err.get("message") or "").splitlines()), "(no message)")[:300])
                                  if err else None}
    out.write_text(json.dumps(result, indent=2))
    return result


def main() -> int:
    import argparse

    sys.path.insert(0, str(ROOT / "scripts"))
    import sweep  # noqa: E402 - noxfile.PAIRS, read without nox

    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", default="")
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results" / "controls"))
    ap.add_argument("--summarize", action="store_true",
                    help="no runs: re-derive call_site from each JSON's recorded traceback and rewrite SUMMARY.md")
    args = ap.parse_args()
    pairs = [tuple(p.split(":")) for p in args.pairs.split(",") if p] or sweep.nox_pairs()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec, vllm in pairs:
        py = None if args.summarize else subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "bed.py"), "python", "--speculators", spec, "--vllm", vllm],
            capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        out = out_dir / f"spec-{spec}_vllm-{vllm}_internals_off.json"
        if args.summarize:
            if not out.exists():
                continue
            r = json.loads(out.read_text())
            r["control"]["call_site"] = call_site((r.get("error") or {}).get("traceback", ""))
            out.write_text(json.dumps(r, indent=2))
        else:
            r = run_control(py, out)
        c = r["control"]
        site = c["call_site"]
        ran = "ran without error: states " + ("match HF row-exact" if r.get("passed") else "do NOT match HF")
        rows.append(f"| {spec} | {vllm} | {c['error'] or ran} | "
                    + (f"`{site['speculators']}` → `{site['vllm']}`" if site else "—") + " |")
        print(rows[-1], flush=True)
    (out_dir / "SUMMARY.md").write_text(
        "# vLLM-internals patches off, the rest on (tests/e2e/internals_control.py)\n\n"
        "Each pair's generator with the import, platform, executor and speculators-script patches on and\n"
        "every patch of the families " + ", ".join(INTERNALS_FAMILIES) + " off; the first call from\n"
        "speculators' generator into vLLM that fails — or, where nothing fails, whether the states match HF\n"
        "(where they do not, the case summaries in the JSON say how: speculators' own `generate` returns one\n"
        "tensor fewer for a repeated default layer id and misplaces rows, max relative error ~0.84).\n"
        "One JSON per pair beside this file (with provenance).\n\n"
        "| speculators | vLLM | error | first failing call: speculators → vLLM |\n| --- | --- | --- | --- |\n"
        + "\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
