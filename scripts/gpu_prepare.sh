#!/usr/bin/env bash
# Prepare .gpu/ for scripts/gpu_run.sh: the CUDA vLLM 0.24 bundle (../shared/gpu recipe), this
# package as a wheel, speculators 0.3.0 / 0.4.0.1, and the few wheels their import needs that
# the GPU image lacks (compressed-tensors: the version vLLM 0.24 pins; the kimi/int4 steps and the INT4 factory need it). MOE=1 also writes .gpu-moe/ (MoE kernels, FlashAttention 3 for MLA prefill; 22 MB) for a second call.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu
[ -f .gpu/build.sh ] || cp ../shared/gpu/*.sh ../shared/gpu/*.py .gpu/
[ -f .gpu/bundle/SHA256SUMS ] || bash .gpu/build.sh
W=.gpu/bundle/whl
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT -d $W \
  "compressed-tensors==0.17.0" 2>&1 | grep -v "is ignored" || true
python3 scripts/gpu_bundle.py --runtime-wheels .gpu/bundle  # this package, wrapt, loguru (every bundle's); checksums
mkdir -p .gpu/spec
for v in 0.3.0 0.4.0.1; do
  ls .gpu/spec/speculators-$v-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps -d .gpu/spec speculators==$v 2>&1 | grep -v "is ignored" || true
done
if [ "${MOE:-0}" = 1 ]; then
  mkdir -p .gpu-moe
  WORK=${TMPDIR:-/tmp}/gpu-bundle-work
  unzip -p $WORK/dl/vllm-0.24.0-*.whl vllm/_moe_C_stable_libtorch.abi3.so > $WORK/_moe_C.so
  python3 .gpu/prune_fatbin.py $WORK/_moe_C.so && xz -9 -T0 -c $WORK/_moe_C.so > .gpu-moe/_moe_C.xz
  # FlashAttention 3 (Hopper only, 153 MB -> 7.9 MB xz): MLA *prefill* on the H200 needs it
  # (vLLM 0.24's MLA backends compute prefill with FA3/FA2, FlashInfer or TRT-LLM; TRITON_MLA only decodes)
  unzip -p $WORK/dl/vllm-0.24.0-*.whl vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so | xz -9e -T0 > .gpu-moe/_vllm_fa3_C.xz
fi
# the carry limit (64 MiB with the checkout) takes the bundle in two calls on one warm machine:
# .gpu_tree (vLLM's tree, ~35 MB) first, then .gpu_whl (wheels, speculators, scripts; ~19 MB) with
# .gpu-moe; scripts/gpu_run.sh joins them into .gpu/ (call 1 also copies the tree to ${TMPDIR:-/tmp}/stage)
rm -rf .gpu_tree .gpu_whl && mkdir -p .gpu_tree .gpu_whl
cp .gpu/bundle/vllm_tree.tar.xz* .gpu_tree/
tar -C .gpu --exclude='vllm_tree.tar.xz*' -cf - . | tar -C .gpu_whl -xf -
du -sh .gpu/bundle .gpu/spec .gpu-moe .gpu_tree .gpu_whl 2>/dev/null || true
echo "carry total: $(du -scb .gpu/bundle .gpu/spec | tail -1 | cut -f1) bytes (+ checkout)"
