"""Build what would be released and check it: the runtime wheel, the sdist and the test bed's
wheel (speculators-compat-testing), `twine check` on all three, and the runtime wheel's contents:
the package, its matrix, the opt-in .pth hook, and nothing of the test bed.

    python scripts/check_dist.py [--out DIR]      (make dist-check; part of make unit)
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="keep the built files here (default: a temporary folder)")
    args = ap.parse_args()
    temporary = args.out is None
    out = Path(args.out or tempfile.mkdtemp(prefix="dist-check-"))
    try:
        return _check(out)
    finally:
        if temporary:
            shutil.rmtree(out, ignore_errors=True)


def _check(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("speculators_compat*")):  # only this build's artefacts are checked
        stale.unlink()
    uv = shutil.which("uv")
    if uv is None:
        print("check_dist: uv not found (pip install uv)", file=sys.stderr)
        return 2
    for target in ([".", "--wheel"], [".", "--sdist"], ["testbed", "--wheel"]):
        proc = subprocess.run([uv, "build", "-q", "-o", str(out), *target], cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"check_dist: uv build {' '.join(target)} failed: {proc.stderr.strip()[-600:]}", file=sys.stderr)
            return 1
    runtime = sorted(out.glob("speculators_compat-*.whl"))
    testbed = sorted(out.glob("speculators_compat_testing-*.whl"))
    sdist = sorted(out.glob("speculators_compat-*.tar.gz"))
    problems = []
    if not (runtime and testbed and sdist):
        problems.append(f"missing artefacts in {out}: {sorted(p.name for p in out.iterdir())}")
    else:
        names = zipfile.ZipFile(runtime[-1]).namelist()
        for needed in ("speculators_compat/__init__.py", "speculators_compat/compat_matrix.yaml",
                       "speculators_compat/extraction/driver.py", "speculators_compat_auto.pth",
                       "_speculators_compat_pth.py"):
            if needed not in names:
                problems.append(f"runtime wheel lacks {needed}")
        leaked = [n for n in names if n.startswith(("speculators_compat/testing/", "speculators_compat_testbed/"))]
        if leaked:
            problems.append(f"runtime wheel holds the test bed: {leaked[:3]}")
        bed = zipfile.ZipFile(testbed[-1]).namelist()
        for needed in ("speculators_compat_testbed/e2e_runner.py", "speculators_compat_testbed/tiny_models.py"):
            if needed not in bed:
                problems.append(f"test-bed wheel lacks {needed}")
        import re

        version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
        pin = re.search(r'"speculators-compat==([^"]+)"', (ROOT / "testbed" / "pyproject.toml").read_text())
        if not pin or pin.group(1) != version:
            problems.append(f"testbed/pyproject.toml must pin speculators-compat=={version} (found {pin.group(1) if pin else 'none'})")
        if any(n.startswith("speculators_compat/") for n in bed):
            problems.append("test-bed wheel holds runtime modules (it must only hold speculators_compat_testbed/)")
        twine = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, runtime + sdist + testbed)],
                               capture_output=True, text=True)
        if twine.returncode != 0:
            problems.append("twine check: " + (twine.stdout + twine.stderr).strip()[-800:])
    for p in problems:
        print(f"check_dist: {p}", file=sys.stderr)
    if not problems:
        sizes = ", ".join(f"{p.name} {p.stat().st_size // 1024} KiB" for p in runtime + sdist + testbed)
        print(f"check_dist: ok ({sizes}); runtime wheel without the test bed; twine check passed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
