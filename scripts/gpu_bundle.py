"""Build the H200 bundle of another CUDA vLLM release: ``.gpuNN/`` from the 0.24 recipe in ``.gpu/``.

``scripts/gpu_prepare.sh`` builds ``.gpu/`` (CUDA vLLM 0.24.0) from the shared recipe
(``.gpu/build.sh``). Every other release that pairs with the image's torch 2.11 (0.20.x-0.26)
runs from a bundle built by the same recipe with these edits, each asserted to match once (a
changed recipe fails here, not half-way through a build):

- the version everywhere (pin, output folder ``.gpuNN/bundle``, scratch ``gpu-bundle-workNN``);
- the wheel: whichever ``vllm-VERSION-*.whl`` the scratch folder holds, else the recipe downloads
  it for any of the manylinux tags vLLM used (0.20.x ships ``manylinux_2_35``, 0.21.0
  ``manylinux_2_24``, 0.23.0 a build tag ``-2-``);
- before 0.24: vLLM also ships ``_C.abi3.so`` (imported by ``platforms/cuda.py``) and names its
  MoE library ``_moe_C.abi3.so`` (both pruned like the others), and
  ``transformers_utils/gguf_utils.py`` imports ``gguf`` on the ``LLM`` import path (its wheel is
  added);
- then the runtime wheels ``scripts/gpu_prepare.sh`` adds to ``.gpu/bundle`` (this package, wrapt,
  loguru) and the checksums again (``add_runtime_wheels``).

    python3 scripts/gpu_bundle.py 0.20.2            # writes .gpu20/ and builds .gpu20/bundle
    python3 scripts/gpu_bundle.py 0.21.0 --no-build # only the recipe
    GPU_BUNDLE=.gpu20/bundle GPU_SITE=${TMPDIR:-/tmp}/site20 GPU_STEPS=e2e bash scripts/gpu_run.sh   # on the H200
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / ".gpu" / "build.sh"
HELPERS = ("prune_fatbin.py", "make_model.py", "smoke.py", "smoke.sh", "probe_imports.py")



def _key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".")[:3] if p.isdigit())


def _replace(text: str, old: str, new: str) -> str:
    if text.count(old) != 1:
        raise SystemExit(f"gpu_bundle: the recipe {RECIPE.relative_to(ROOT)} changed: expected once {old!r}, "
                         f"found {text.count(old)} times")
    return text.replace(old, new)


def recipe(version: str, folder: str) -> str:
    """The 0.24 recipe edited for ``version`` (see the module docstring)."""
    s = RECIPE.read_text()
    tag = folder.lstrip(".").replace("gpu", "")
    s = _replace(s, "running real CUDA vLLM 0.24.0", f"running real CUDA vLLM {version}")
    s = _replace(s, "[path/to/vllm-0.24.0-*.whl]", f"[path/to/vllm-{version}-*.whl]")
    s = _replace(s, "# Output: .gpu/bundle/", f"# Output: {folder}/bundle/")
    s = _replace(s, "/gpu-bundle-work}", f"/gpu-bundle-work{tag}}}")
    # the wheel's file name varies (manylinux_2_35 / _2_24 tags, build tags like -1-): the default
    # is whatever vllm-VERSION wheel the scratch folder holds, else the recipe downloads one
    s = _replace(s, "WHEEL=${1:-$WORK/dl/vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl}",
                 f'WHEEL=${{1:-$(ls "$WORK"/dl/vllm-{version}-*.whl 2>/dev/null | head -1 || true)}}\n'
                 f"WHEEL=${{WHEEL:-$WORK/dl/vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl}}")
    s = _replace(s, '--platform manylinux_2_28_x86_64 -d "$(dirname "$WHEEL")" vllm==0.24.0',
                 "--platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 "
                 f'-d "$(dirname "$WHEEL")" vllm=={version}\n'
                 f'  WHEEL=$(ls "$(dirname "$WHEEL")"/vllm-{version}-*.whl | head -1)')
    if _key(version) < (0, 24):
        s = _replace(s, '[ "$KEEP_MOE" = 1 ] || rm -f "$V"/_moe_C_stable_libtorch.abi3.so\n',
                     '[ "$KEEP_MOE" = 1 ] || rm -f "$V"/_moe_C_stable_libtorch.abi3.so "$V"/_moe_C.abi3.so  # < 0.24: _moe_C.abi3.so\n')
        s = _replace(s, 'for so in "$V"/_C_stable_libtorch.abi3.so "$V"/_moe_C_stable_libtorch.abi3.so; do',
                     "# < 0.24 also ships _C.abi3.so (torch C++ ABI, imported by platforms/cuda.py) and names the MoE lib _moe_C.abi3.so\n"
                     'for so in "$V"/_C_stable_libtorch.abi3.so "$V"/_moe_C_stable_libtorch.abi3.so "$V"/_C.abi3.so "$V"/_moe_C.abi3.so; do')
        s = _replace(s, 'apache-tvm-ffi==0.1.15.post2 2>&1 | grep -v "is ignored" || true',
                     "apache-tvm-ffi==0.1.15.post2 \\\n"
                     "  gguf==0.19.0 2>&1 | grep -v \"is ignored\" || true  # < 0.24: gguf_utils imports gguf at module level")
    return s


def add_runtime_wheels(bundle: Path) -> None:
    """The wheels every bundle needs besides the recipe's (``scripts/gpu_prepare.sh`` adds them to
    ``.gpu/bundle`` through this too): this package as a wheel and the two its import and
    speculators' need that the image lacks (wrapt, loguru); then the bundle's checksums again."""
    whl = bundle / "whl"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
                    "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform",
                    "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64",
                    "-d", str(whl), "wrapt==2.5.2", "loguru==0.7.3"], check=True)
    for old in whl.glob("speculators_compat-*.whl"):
        old.unlink()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(whl), str(ROOT)], check=True)
    files = sorted(p for p in bundle.rglob("*") if p.is_file() and p.name != "SHA256SUMS")
    sums = subprocess.run(["sha256sum", *[f"./{p.relative_to(bundle)}" for p in files]], cwd=bundle, check=True,
                          capture_output=True, text=True).stdout
    (bundle / "SHA256SUMS").write_text(sums)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("version", nargs="?", help="CUDA vLLM release, e.g. 0.20.2")
    ap.add_argument("--runtime-wheels", metavar="BUNDLE", default=None,
                    help="only add the runtime wheels to BUNDLE and re-checksum it (gpu_prepare.sh, for .gpu/bundle)")
    ap.add_argument("--folder", default=None, help="bundle folder (default .gpuNN, NN the minor version)")
    ap.add_argument("--no-build", action="store_true", help="write the recipe only")
    args = ap.parse_args(argv)
    if args.runtime_wheels:
        add_runtime_wheels(ROOT / args.runtime_wheels)
        return 0
    if not args.version:
        ap.error("give a vLLM version (or --runtime-wheels BUNDLE)")
    if not RECIPE.exists():
        print("gpu_bundle: .gpu/build.sh missing: run scripts/gpu_prepare.sh first (it copies the shared recipe)",
              file=sys.stderr)
        return 2
    folder = args.folder or f".gpu{_key(args.version)[1]}"
    out = ROOT / folder
    out.mkdir(exist_ok=True)
    (out / "build.sh").write_text(recipe(args.version, folder))
    for name in HELPERS:
        if (ROOT / ".gpu" / name).exists():
            shutil.copy2(ROOT / ".gpu" / name, out / name)
    print(f"gpu_bundle: wrote {folder}/build.sh for vLLM {args.version}")
    if args.no_build:
        return 0
    rc = subprocess.run(["bash", str(out / "build.sh")], cwd=ROOT).returncode
    if rc == 0:
        add_runtime_wheels(out / "bundle")
    return rc


if __name__ == "__main__":
    sys.exit(main())
