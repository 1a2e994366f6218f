"""Versions and PyPI access: the simple index, installable wheels, their metadata (PEP 658 or HTTP
range reads, cached), Requires-Dist lines, markers and specifiers for linux x86_64 CPython."""

from __future__ import annotations

import io
import json
import re
import time
import urllib.request
import zipfile

from .common import CACHE, PYPI_SIMPLE, PYTHON_MINOR, BedError


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
