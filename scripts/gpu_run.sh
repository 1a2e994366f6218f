#!/usr/bin/env bash
# Everything the GPU issue asks for, in one device call (H200, CUDA vLLM 0.24 from the bundle).
#
# Here (CPU machine), once:   bash scripts/gpu_prepare.sh        # .gpu/bundle + our wheels
# Then:                       python -m speculators_compat_testbed.provenance --stamp
# and one device call:        command "bash scripts/gpu_run.sh", carry [".gpu", ".checkout.json"]
# (checkout + bundle over the 64 MiB carry: call 1 carries [".gpu_tree", ".checkout.json"] and only copies
# .gpu_tree/* to ${TMPDIR:-/tmp}/stage; call 2, on the still-warm machine, [".gpu_whl", ".gpu-moe", ".checkout.json"])
# Results land in $OUT (copied back); commit them under benchmarks/results/gpu/. scripts/gpu_plan.sh
# runs several steps in priority order within one call, each packed apart (a call cut short keeps them).
#
# The checkout's src/ comes first on PYTHONPATH (the installed wheel supplies the vllm.general_plugins
# entry point), so code changes need no new wheel.
# Steps: install the bundle (vLLM 0.24 + deps) into $TMPDIR/site, speculators 0.3.0 and 0.4.0.1
# into their own folders; then e2e cells (llama, qwen3) x (0.3.0, 0.4.0.1) against HF on the same
# GPU, in parallel; then the throughput benchmark (shim vs native prefill).
# JOB_SHAPE / JOB_ARGS / JOB_TAG: the job step's model shape, extra arguments (e.g. --fp8-side: the script with FP8
# storage as a third side) and result-name suffix.
# GPU_STEPS selects: "e2e bench" (default), "start" (a worker that cannot start: its cause in the caller's error), "pipeoff" (shim alone, serial vs pipelined driver), "bench16" (16 layers, 7 reps), "noasync" (native without async scheduling), "hook" (hook micro-benchmark), "tp2" (TP=2 + Llava; kind nvidia-h200-x2), "job" (speculators' script end to end vs the generator alone), "save" (the save path beside a busy Python thread, and the disk), "capture" (capture cost at hidden 4096: 3 layers vs 1), "capture32" (the same at the 8B-like 32-layer shape, 4 layers vs 1, batch 64 and 128), "selfcheck" (the self-check's cost at an 8B-like shape), "nopin", "hybrid" (Qwen3.5 / Qwen3-Next tiny e2e cells), "mla" / "mlaref" / "kimi" / "int4" (DeepSeek-V3 / Kimi-K2.5 tiny / Kimi-K2.5 INT4 W4A16, need the MoE kernels:
# MOE=1 scripts/gpu_prepare.sh writes .gpu-moe/; carry it in a second call on the warm machine).
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_USE_FLASHINFER_SAMPLER=0
export SPECULATORS_COMPAT_ATTENTION_BACKEND=${SPECULATORS_COMPAT_ATTENTION_BACKEND:-TRITON_ATTN}
export SPECULATORS_COMPAT_KV_CACHE_BYTES=${SPECULATORS_COMPAT_KV_CACHE_BYTES:-20000000000}
SCRATCH=${TMPDIR:-/tmp}
export SPECULATORS_COMPAT_MODEL_CACHE=$SCRATCH/models
export OUT=${OUT:-$SCRATCH/out}; mkdir -p "$OUT"
# GPU_BUNDLE / GPU_SITE: another CUDA vLLM release's bundle (e.g. .gpu26/bundle, built by
# .gpu26/build.sh from ../shared/gpu/build.sh with the version changed) and its install folder
B=${GPU_BUNDLE:-.gpu/bundle}; SITE=${GPU_SITE:-$SCRATCH/site}
# the bundle carried in two halves (scripts/gpu_prepare.sh): join them (call 1 left the tree in .gpu_tree or $TMPDIR/stage)
# (the tree first: SHA256SUMS, from .gpu_whl, appears only once both halves are in, so a failed join is retried)
if [ ! -f "$B/SHA256SUMS" ] && [ -d .gpu_whl ]; then
  mkdir -p "$B"
  cp .gpu_tree/vllm_tree.tar.xz* "$B/" 2>/dev/null || cp "${TMPDIR:-/tmp}"/stage/vllm_tree.tar.xz* "$B/" || { echo "bundle half missing: vllm_tree.tar.xz"; exit 2; }
  cp -r .gpu_whl/. "$(dirname "$B")/"
fi
exec > >(tee "$OUT/gpu_run.log") 2>&1
# Provenance: the device's copy of the checkout may hold a .git of an older commit (the work tree
# is ours, its history is not). When .checkout.json (python -m speculators_compat_testbed.provenance
# --stamp, here before the call) names a commit other than that .git's HEAD, that .git is moved
# aside for the run, so provenance hashes src/ from the files and binds the result to the stamp.
if [ -d .git-device ] && [ ! -e .git ]; then mv -T .git-device .git; fi  # an earlier run cut off before its trap
if [ -f .checkout.json ] && [ -d .git ]; then
  stamped=$(python3 -c 'import json; print(json.load(open(".checkout.json"))["commit"])')
  if [ "$(git rev-parse HEAD 2>/dev/null)" != "$stamped" ]; then
    rm -rf .git-device && mv -T .git .git-device && trap 'mv -T .git-device .git' EXIT
    echo "provenance: the device's .git is not at the stamped commit ${stamped:0:10}: moved aside for this run"
  fi
fi
STEPS=${GPU_STEPS:-e2e bench}
echo "== host"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
if [ ! -f "$SITE/vllm/_C_stable_libtorch.abi3.so" ]; then
  (cd $B && sha256sum --quiet -c SHA256SUMS) || { echo "checksum mismatch"; exit 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" $B/whl/*.whl || exit 3
  cat $B/vllm_tree.tar.xz* | xz -d -T0 | tar -x -C "$SITE" || exit 4
fi
# a site installed from an older bundle (a warm machine) lacks wheels added since: compressed-tensors (kimi, int4)
if ls $B/whl/compressed_tensors-*.whl >/dev/null 2>&1 && [ ! -d "$SITE/compressed_tensors" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" $B/whl/compressed_tensors-*.whl || echo "compressed-tensors install failed"
fi
if [ -f .gpu-moe/_moe_C.xz ] && [ ! -f "$SITE/vllm/_moe_C_stable_libtorch.abi3.so" ]; then
  xz -d -c .gpu-moe/_moe_C.xz > "$SITE/vllm/_moe_C_stable_libtorch.abi3.so"
fi
if [ -f .gpu-moe/_vllm_fa3_C.xz ] && [ ! -f "$SITE/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so" ]; then
  xz -d -c .gpu-moe/_vllm_fa3_C.xz > "$SITE/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"
fi
for v in 0.3.0 0.4.0.1; do
  [ -d $SCRATCH/spec-$v/speculators ] || python3 -m pip install -q --no-index --no-deps --target $SCRATCH/spec-$v .gpu/spec/speculators-$v-*.whl
done
cell() {  # speculators-version arch [extra runner args]
  local v=$1 a=$2 n=${CELL_NAME:-$2}; shift 2
  # CELL_ONLY="0.4.0.1:deepseek_v3 0.3.0:kimi_k25_int4_vllmref": run only these cells (version:name); a pair of a step
  # then runs one after the other (e.g. --settle's second engine without a neighbour's memory moving under its profile)
  if [ -n "${CELL_ONLY:-}" ] && [[ " $CELL_ONLY " != *" $v:$n "* ]]; then return 0; fi
  PYTHONPATH=$PWD/src:$PWD/testbed:$SCRATCH/spec-$v:$SITE timeout 420 python3 -m speculators_compat_testbed.e2e_runner \
    --arch "$a" --out "$OUT/e2e_spec-${v}_${n}.json" --gpu-memory-utilization 0.15 "$@" ${CELL_EXTRA:-} > "$OUT/e2e_spec-${v}_${n}.log" 2>&1
  echo "cell $v $a rc=$?"
}
t0=$(date +%s)
PYTHONPATH=$SITE python3 -c 'import vllm, speculators_compat; print("vllm", vllm.__version__)'
# vLLM's workers activate the shim through the vllm.general_plugins entry point of an INSTALLED
# speculators_compat (its code still comes from the checkout's src/, first on PYTHONPATH): without
# its dist-info in the site a spawned worker runs speculators unpatched (transformers 5: NameError 'torch')
ls -d "$SITE"/speculators_compat-*.dist-info >/dev/null 2>&1 || { echo "site lacks speculators_compat's wheel (entry point): pip install --target $SITE <its wheel>"; exit 6; }
# preflight: the modules speculators' generator imports (a bundle missing a wheel, e.g. llguidance,
# whose annotation vllm.v1.request evaluates, fails every cell at import: stop here instead)
PYTHONPATH=$SITE python3 -c 'import vllm.v1.request, vllm.v1.core.kv_cache_utils' || { echo "bundle incomplete: vLLM's engine modules do not import"; exit 5; }
if [[ " $STEPS " == *" e2e "* ]]; then
  echo "== e2e cells"
  # (wait on the two pids only: a bare `wait` would also wait for the tee of `exec > >(tee ...)`)
  cell 0.3.0 llama & p1=$!; cell 0.4.0.1 llama & p2=$!; cell 0.3.0 qwen3 & p3=$!; cell 0.4.0.1 qwen3 & p4=$!
  wait $p1 $p2 $p3 $p4
  echo "e2e done at +$(( $(date +%s) - t0 ))s"
fi
if [[ " $STEPS " == *" rehearse "* ]]; then
  echo "== check --model on the released configs (tests/data/released_configs), speculators 0.4.0.1"
  # REHEARSE_ARGS: more check --model arguments, e.g. "--tensor-parallel-size 2" on nvidia-h200-x2, with
  # REHEARSE_LABEL_TAG=_tp2 (the result file's name)
  VV=$(PYTHONPATH=$SITE python3 -c 'from importlib.metadata import version; print(version("vllm"))')
  DENSE_ONLY=${REHEARSE_DENSE-gemma-3-1b-it,llama-3.1-8b-instruct,mistral-7b-v0.1,qwen3-8b}
  MOE_ONLY=${REHEARSE_MOE:-}
  MLA_ONLY=${REHEARSE_MLA:-}
  for group in "$DENSE_ONLY:TRITON_ATTN" "$MOE_ONLY:TRITON_ATTN" "$MLA_ONLY:TRITON_MLA"; do
    only=${group%%:*}; backend=${group##*:}; [ -n "$only" ] || continue
    # REHEARSE_PARALLEL=1: one process per config at once (each engine's KV cache capped); an engine that
    # starts while another process frees GPU memory fails vLLM's memory profiling (logs/s27, Kimi-K2.5)
    if [ "${REHEARSE_PARALLEL:-0}" = 1 ]; then
      pids=()
      for slug in ${only//,/ }; do
        SPECULATORS_COMPAT_KV_CACHE_BYTES=4000000000 SPECULATORS_COMPAT_REHEARSAL_GPU_MEM=0.12 SPECULATORS_COMPAT_ATTENTION_BACKEND=$backend \
          PYTHONPATH=$PWD/src:$PWD/testbed:$SCRATCH/spec-0.4.0.1:$SITE timeout ${REHEARSE_TIMEOUT:-500} python3 scripts/rehearse_released.py \
          --label "gpu_spec-0.4.0.1_vllm-${VV}${REHEARSE_LABEL_TAG:-}_$slug" --only "$slug" --out-dir "$OUT" \
          ${REHEARSE_ARGS:+--check-args "$REHEARSE_ARGS"} > "$OUT/rehearse_$slug.log" 2>&1 & pids+=($!)
      done
      wait "${pids[@]}"
      continue
    fi
    SPECULATORS_COMPAT_ATTENTION_BACKEND=$backend PYTHONPATH=$PWD/src:$PWD/testbed:$SCRATCH/spec-0.4.0.1:$SITE \
      timeout ${REHEARSE_TIMEOUT:-500} python3 scripts/rehearse_released.py --label "gpu_spec-0.4.0.1_vllm-$VV${REHEARSE_LABEL_TAG:-}" \
      --only "$only" --out-dir "$OUT" ${REHEARSE_CONTROLS:+--controls "$REHEARSE_CONTROLS"} ${REHEARSE_ARGS:+--check-args "$REHEARSE_ARGS"}
    REHEARSE_CONTROLS=
  done
  echo "rehearse done at +$(( $(date +%s) - t0 ))s"
fi
if [[ " $STEPS " == *" v1 "* ]]; then
  echo "== e2e cells with the V1 model runner forced (VLLM_USE_V2_MODEL_RUNNER=0)"
  export VLLM_USE_V2_MODEL_RUNNER=0
  CELL_NAME=llama_v1runner cell 0.3.0 llama & p1=$!; CELL_NAME=llama_v1runner cell 0.4.0.1 llama & p2=$!
  CELL_NAME=qwen3_v1runner cell 0.3.0 qwen3 & p3=$!; CELL_NAME=qwen3_v1runner cell 0.4.0.1 qwen3 & p4=$!
  wait $p1 $p2 $p3 $p4
  unset VLLM_USE_V2_MODEL_RUNNER
fi
if [[ " $STEPS " == *" start "* ]]; then
  echo "== a worker that cannot start (corrupt weights): the caller's exception, with the shim and without"
  PYTHONPATH=$PWD/src:$PWD/testbed:$SCRATCH/spec-0.4.0.1:$SITE timeout 500 python3 scripts/worker_start_check.py \
    --out "$OUT/worker_start_h200.json" > "$OUT/worker_start_h200.log" 2>&1; echo "start rc=$?"
fi
if [[ " $STEPS " == *" faults "* ]]; then
  echo "== fault battery on the GPU (Ctrl-C at every reply read, lost rows, worker exception, ...)"
  PYTHONPATH=$PWD/src:$PWD/testbed:$SCRATCH/spec-0.4.0.1:$SITE timeout 400 python3 -m speculators_compat_testbed.fault_runner --fault recover \
    --timeout 60 --out "$OUT/faults_recover_h200.json" > "$OUT/faults_recover_h200.log" 2>&1; echo "faults rc=$?"
fi
# Router near-ties (issue #14): every MoE cell below (mla: HF reference; mlaref / kimi: the engine's own
# forward, HF recorded beside it) records each reference's router top-k margins (sigmoid +
# e_score_correction_bias, group-limited top-k) and lists, per case, the rows over the 0.1 row bound
# it explains by a near-tie (rows_explained, explained_rows: seq, layer, row, error, margin,
# margin_layer) and those it does not (unexplained_rows, with why); "passed" stays False for any
# unexplained row. See reference.MARGIN_TIE / EXPLAINED_CAP.
if [[ " $STEPS " == *" hybrid "* ]]; then
  echo "== Qwen3.5 (released VL layout) and Qwen3-Next tiny: gated delta-net + full attention, 512-token chunks"
  # the bundle lacks FlashInfer's GDN kernel that vLLM picks on Hopper: Triton's (as the rehearsals ran);
  # qwen3_next needs the MoE kernels (.gpu-moe/, MOE=1 scripts/gpu_prepare.sh); HYBRID_ARCHS picks
  export SPECULATORS_COMPAT_ADDITIONAL_CONFIG=${HYBRID_ADDITIONAL_CONFIG-'{"gdn_prefill_backend": "triton"}'}
  for a in ${HYBRID_ARCHS:-qwen3_5}; do
    cell 0.3.0 "$a" --dtype bfloat16 --max-num-batched-tokens 512 & p1=$!
    cell 0.4.0.1 "$a" --dtype bfloat16 --max-num-batched-tokens 512 & p2=$!; wait $p1 $p2
  done
  unset SPECULATORS_COMPAT_ADDITIONAL_CONFIG
fi
if [[ " $STEPS " == *" mla "* ]] && [ "${SITE_READY:-1}" = 1 ]; then
  echo "== DeepSeek-V3 tiny on the real MLA path"
  export SPECULATORS_COMPAT_ATTENTION_BACKEND=${MLA_BACKEND:-TRITON_MLA}
  # vLLM 0.24's MLA kernels take: decode head size kv_lora_rank + qk_rope_head_dim in {320, 576};
  # FA3 prefill (diff. head dims): Q/K head dim (nope + rope) in (128, 192], V head dim in (96, 128]
  MLA='{"kv_lora_rank": 256, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}'
  cell 0.3.0 deepseek_v3 --overrides "$MLA" & p1=$!; cell 0.4.0.1 deepseek_v3 --overrides "$MLA" & p2=$!; wait $p1 $p2
  # the same model with every layer dense (no MoE): MLA alone, free of bf16 expert near-ties
  DENSE='{"kv_lora_rank": 256, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "first_k_dense_replace": 4}'
  CELL_NAME=deepseek_v3_dense cell 0.3.0 deepseek_v3 --overrides "$DENSE" & p1=$!
  CELL_NAME=deepseek_v3_dense cell 0.4.0.1 deepseek_v3 --overrides "$DENSE" & p2=$!; wait $p1 $p2
fi
if [[ " $STEPS " == *" mlaref "* ]] && [ "${SITE_READY:-1}" = 1 ]; then
  echo "== DeepSeek-V3 MoE on the MLA path vs the same engine's own forward (bf16 expert near-ties vs HF)"
  export SPECULATORS_COMPAT_ATTENTION_BACKEND=${MLA_BACKEND:-TRITON_MLA}
  MLA='{"kv_lora_rank": 256, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}'
  CELL_NAME=deepseek_v3_mla_moe_vllmref cell 0.3.0 deepseek_v3 --overrides "$MLA" --reference vllm & p1=$!
  CELL_NAME=deepseek_v3_mla_moe_vllmref cell 0.4.0.1 deepseek_v3 --overrides "$MLA" --reference vllm & p2=$!; wait $p1 $p2
fi
if [[ " $STEPS " == *" kimi "* ]] && [ "${SITE_READY:-1}" = 1 ]; then
  echo "== Kimi-K2.5 tiny (KimiK25ForConditionalGeneration: DeepSeek-V3 text inside the wrapper) on the MLA path vs the same engine's own forward"
  # needs the MoE kernels (.gpu-moe/, MOE=1 scripts/gpu_prepare.sh); the factory's text_config already
  # has the MLA dims the H200 kernels take (kv_lora_rank 256, rope 64, nope 128, v 128); bf16 (the
  # generator's "auto"): expert near-ties make HF no reference there, the engine's own forward is
  export SPECULATORS_COMPAT_ATTENTION_BACKEND=${MLA_BACKEND:-TRITON_MLA}
  CELL_NAME=kimi_k25_mla_vllmref cell 0.3.0 kimi_k25 --reference vllm & p1=$!
  CELL_NAME=kimi_k25_mla_vllmref cell 0.4.0.1 kimi_k25 --reference vllm & p2=$!; wait $p1 $p2
fi
if [[ " $STEPS " == *" int4 "* ]] && [ "${SITE_READY:-1}" = 1 ]; then
  echo "== Kimi-K2.5 INT4 as released (compressed-tensors pack-quantized W4A16, int4 sym, group 32, routed experts) on the MLA path"
  # needs .gpu-moe/ (MOE=1 scripts/gpu_prepare.sh) and compressed-tensors 0.17.0 among the bundle's wheels (vLLM 0.24 pins it):
  # vLLM 0.24 picks CompressedTensorsWNA16MarlinMoEMethod (hidden 128 % 128, intermediate 128 % max(64, 32), group 32 are
  # what check_moe_marlin_supports_layer takes): the GEMM is torch.ops._moe_C.moe_wna16_marlin_gemm (_moe_C), the weight
  # repack torch.ops._C.gptq_marlin_repack (_C). The factory's text_config has the MLA dims the H200 kernels take.
  # Each cell: the capture vs the same engine's own forward on the packed checkpoint (decides), and vs HF on the
  # dequantized copy (recorded under references.hf; bf16 expert near-ties and Marlin's bf16 dequant are expected there)
  export SPECULATORS_COMPAT_ATTENTION_BACKEND=${MLA_BACKEND:-TRITON_MLA}
  PYTHONPATH=$PWD/src:$PWD/testbed:$SITE python3 -c 'import compressed_tensors as ct, torch
print("compressed-tensors", ct.__version__)
import vllm._C_stable_libtorch, vllm._moe_C_stable_libtorch  # what CudaPlatform.import_kernels loads
print("ops: _moe_C.moe_wna16_marlin_gemm", hasattr(torch.ops._moe_C, "moe_wna16_marlin_gemm"), "_C.gptq_marlin_repack", hasattr(torch.ops._C, "gptq_marlin_repack"))
import vllm.model_executor.models.kimi_k25; print("kimi_k25 module imports")' 2>&1 | tail -20
  CELL_NAME=kimi_k25_int4_vllmref cell 0.3.0 kimi_k25 --quantization w4a16 --reference vllm --reference-timeout 300 & p1=$!
  CELL_NAME=kimi_k25_int4_vllmref cell 0.4.0.1 kimi_k25 --quantization w4a16 --reference vllm --reference-timeout 300 & p2=$!; wait $p1 $p2
  for f in "$OUT"/e2e_spec-*_kimi_k25_int4_vllmref.log; do echo "-- $f"; grep -E "Error|error:|Using .*MoE|WNA16|Marlin" "$f" | grep -v "^ " | tail -8; done
fi
if [[ " $STEPS " == *" bench "* ]]; then
  echo "== throughput: shim vs native prefill"
  # four engines on one GPU: the generator (KV 20 GB), the 1-layer capture control (the same), vLLM's LLM
  # and vLLM's own extraction (0.2 each)
  SPECULATORS_COMPAT_KV_CACHE_BYTES=20000000000 BENCH_GPU_UTIL=0.2 PYTHONPATH=$PWD/src:$PWD/testbed:$SCRATCH/spec-0.4.0.1:$SITE timeout ${BENCH_TIMEOUT:-400} python3 benchmarks/throughput.py --hidden 2048 --layers 8 \
    --batch 32 --prompt-len 512 1024 2048 --reps 5 --max-model-len 4096 --vllm-extract --capture-control --out "$OUT/throughput_h200.json" \
    > "$OUT/throughput_h200.log" 2>&1; echo "bench rc=$?"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader
fi
if [[ " $STEPS " == *" job "* ]]; then
  echo "== whole-job throughput: speculators' released script under speculators-compat run vs the generator alone"
  # speculators 0.4.0.1's data_generation_offline.py (tests/e2e/speculators_scripts), Llama hidden 2048 x 8 layers,
  # 2 x 32 chat conversations (512-1024 and 1024-2048 tokens), batch 8: a warm-up run + 2 repetitions of each side
  # (~1 min per script run: imports, preprocessing, engine start); the data files go to $SCRATCH/job (disk).
  # The script's preprocessing needs HF datasets, which neither the image nor the bundle holds: carry its
  # wheels in .gpu/job-whl (here: python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12
  # --implementation cp --platform manylinux_2_28_x86_64 -d .gpu/job-whl datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash; speculators imports
  # under the shim, as the script does under run: without it pydantic fails on speculators' torch annotation)
  if [ -d .gpu/job-whl ] && [ ! -d "$SITE/datasets" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .gpu/job-whl/*.whl || echo "job: wheel install failed"
  fi
  PYTHONPATH=$PWD/src:$PWD/testbed:$SCRATCH/spec-0.4.0.1:$SITE python3 -c 'import speculators_compat, datasets, pyarrow, speculators.data_generation.preprocessing; print("datasets", datasets.__version__, "pyarrow", pyarrow.__version__)' \
    || echo "job: the script's imports fail (datasets missing? carry .gpu/job-whl)"
  job_dd() {  # JOB_DD=1: the disk's write speed where the job writes (4 GiB, fdatasync), beside the job
    [ -n "${JOB_DD:-}" ] || return 0
    mkdir -p "$SCRATCH/job"; echo "dd $1 the job: $(dd if=/dev/zero of="$SCRATCH/job/ddtest" bs=64M count=64 conv=fdatasync 2>&1 | tail -1)" | tee -a "$OUT/job_dd${JOB_TAG:-}.txt"
    rm -f "$SCRATCH/job/ddtest"
  }
  job_dd before
  SPECULATORS_COMPAT_KV_CACHE_BYTES=20000000000 PYTHONPATH=$PWD/src:$PWD/testbed:$SCRATCH/spec-0.4.0.1:$SITE timeout ${JOB_TIMEOUT:-300} python3 benchmarks/job_throughput.py \
    ${JOB_SHAPE:---hidden 2048 --layers 8 --n 32 --batch-size 8} --seq-length 2048 --reps ${JOB_REPS:-2} --gpu-util 0.4 \
    --script tests/e2e/speculators_scripts/v0.4.0.1/data_generation_offline.py --work "$SCRATCH/job" ${JOB_ARGS:-} \
    --script-timeout 150 --out "$OUT/job_throughput_h200${JOB_TAG:-}.json" > "$OUT/job_throughput_h200${JOB_TAG:-}.log" 2>&1; echo "job rc=$?"
  job_dd after
  for f in "$SCRATCH"/job/*.script.log; do [ -f "$f" ] && cp "$f" "$OUT/job_$(basename "$f" .script.log)_script.log"; done
  rm -rf "$SCRATCH/job"
fi
if [[ " $STEPS " == *" save "* ]]; then
  echo "== the save path beside a busy Python thread (benchmarks/save_interference.py) and the disk's write speed"
  for d in "$SCRATCH" .; do dd if=/dev/zero of="$d/ddtest" bs=64M count=64 conv=fdatasync 2>&1 | tail -1; rm -f "$d/ddtest"; done
  PYTHONPATH=$PWD/src:$PWD/testbed timeout 110 python3 benchmarks/save_interference.py --reps 3 --dir "$SCRATCH" \
    --out "$OUT/save_interference_h200.json" > "$OUT/save_interference_h200.log" 2>&1; echo "save rc=$?"
  # unpaced: as fast as the threads go, so the save path's own ceiling shows (session 29: the hash on 4 threads)
  PYTHONPATH=$PWD/src:$PWD/testbed timeout 130 python3 benchmarks/save_interference.py --reps 4 --rate-gbs 0 --samples 64 \
    --dir "$SCRATCH" --out "$OUT/save_interference_h200_unpaced.json" > "$OUT/save_interference_h200_unpaced.log" 2>&1; echo "save unpaced rc=$?"
fi
if [[ " $STEPS " == *" selfcheck "* ]]; then
  echo "== the self-check's cost at an 8B-like shape (hidden 4096 x 32 layers, 4 captured): same generator, check on vs off, alternating"
  SPECULATORS_COMPAT_KV_CACHE_BYTES=20000000000 PYTHONPATH=$PWD/src:$PWD/testbed:$SCRATCH/spec-0.4.0.1:$SITE timeout ${BENCH_TIMEOUT:-420} python3 benchmarks/throughput.py --hidden 4096 --layers 32 \
    --capture 2,16,29,31 --batch ${SELFCHECK_BATCH:-64} --prompt-len ${SELFCHECK_LENS:-128 512} --reps ${SELFCHECK_REPS:-11} ${SELFCHECK_REPS_AT:+--reps-at $SELFCHECK_REPS_AT} --max-model-len 2048 --no-native --self-check-control --settle-calls ${SELFCHECK_SETTLE:-0} \
    --gpu-util 0.5 --out "$OUT/throughput_h200_selfcheck.json" > "$OUT/throughput_h200_selfcheck.log" 2>&1; echo "selfcheck bench rc=$?"
fi
if [[ " $STEPS " == *" capture "* ]]; then
  echo "== capture cost at a wider shape (hidden 4096 x 8 layers, intermediate 8192): 3 layers vs the 1-layer control, shim only"
  SPECULATORS_COMPAT_KV_CACHE_BYTES=20000000000 PYTHONPATH=$PWD/src:$PWD/testbed:$SCRATCH/spec-0.4.0.1:$SITE timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/throughput.py --hidden 4096 --layers 8 \
    --batch ${CAPTURE_BATCH:-32} --prompt-len ${CAPTURE_LENS:-512 1024 2048} --reps ${CAPTURE_REPS:-7} --max-model-len 4096 --no-native --capture-control --gpu-util 0.3 --out "$OUT/throughput_h200_h4096_capture${CAPTURE_TAG:-}.json" \
    > "$OUT/throughput_h200_h4096_capture${CAPTURE_TAG:-}.log" 2>&1; echo "capture bench rc=$?"
fi
if [[ " $STEPS " == *" capture32 "* ]]; then
  # CAPTURE_REPS_AT / SELFCHECK_REPS_AT: repetitions per prompt length, e.g. "128=41 256=31" (throughput.py --reps-at)
  # CAPTURE_CHECK_ROWS: the self-check's rows in both arms (default 0: off, so the ratio is the capture
  # alone; the self-check's own cost is the "selfcheck" step's)
  echo "== capture cost at the 8B-like shape (hidden 4096 x 32 layers): 4 layers [2,16,29,31] vs the 1-layer control [31], shim only, per batch, self-check rows ${CAPTURE_CHECK_ROWS:-0}"
  for b in ${CAPTURE_BATCHES:-64 128}; do
    SPECULATORS_COMPAT_SELF_CHECK_ROWS=${CAPTURE_CHECK_ROWS:-0} SPECULATORS_COMPAT_KV_CACHE_BYTES=20000000000 PYTHONPATH=$PWD/src:$PWD/testbed:$SCRATCH/spec-0.4.0.1:$SITE timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/throughput.py --hidden 4096 --layers 32 \
      --capture 2,16,29,31 --batch $b --prompt-len ${CAPTURE_LENS:-128 256 512 1024} --reps ${CAPTURE_REPS:-15} ${CAPTURE_REPS_AT:+--reps-at $CAPTURE_REPS_AT} --max-model-len 2048 --no-native --capture-control --gpu-util 0.3 \
      --out "$OUT/throughput_h200_capture32_b$b.json" > "$OUT/throughput_h200_capture32_b$b.log" 2>&1; echo "capture32 b$b rc=$?"
  done
fi
if [[ " $STEPS " == *" noasync "* ]]; then
  echo "== throughput vs native without async scheduling (as the generator's engine runs)"
  SPECULATORS_COMPAT_KV_CACHE_BYTES=40000000000 PYTHONPATH=$PWD/src:$PWD/testbed:$SCRATCH/spec-0.4.0.1:$SITE timeout 300 python3 benchmarks/throughput.py --hidden 2048 --layers 8 \
    --batch 32 --prompt-len 512 1024 2048 --reps 5 --max-model-len 4096 --native-async-scheduling off \
    --out "$OUT/throughput_h200_native_noasync.json" > "$OUT/throughput_h200_native_noasync.log" 2>&1; echo "bench noasync rc=$?"
fi
if [[ " $STEPS " == *" tp2 "* ]]; then
  echo "== tensor_parallel_size=2 (needs 2 GPUs) and a multimodal wrapper (Llava)"
  cell 0.4.0.1 llama --tensor-parallel-size 2 & p1=$!; cell 0.4.0.1 llava & p2=$!; wait $p1 $p2
  [ -f "$OUT/e2e_spec-0.4.0.1_llama.json" ] && mv "$OUT/e2e_spec-0.4.0.1_llama.json" "$OUT/e2e_spec-0.4.0.1_llama_tp2.json"
fi
if [[ " $STEPS " == *" bench16 "* ]]; then
  echo "== throughput, 16 layers (hidden 2048), 7 repetitions: shim vs native prefill"
  SPECULATORS_COMPAT_KV_CACHE_BYTES=40000000000 PYTHONPATH=$PWD/src:$PWD/testbed:$SCRATCH/spec-0.4.0.1:$SITE timeout 560 python3 benchmarks/throughput.py --hidden 2048 --layers 16 \
    --batch 32 --prompt-len 512 1024 2048 --reps 7 --max-model-len 4096 --out "$OUT/throughput_h200_16l.json" \
    > "$OUT/throughput_h200_16l.log" 2>&1; echo "bench16 rc=$?"
fi
if [[ " $STEPS " == *" pipeoff "* ]]; then
  echo "== shim throughput with the serial driver (SPECULATORS_COMPAT_PIPELINE=0: one batch in flight, no async scheduling)"
  for mode in 0 1; do
    SPECULATORS_COMPAT_PIPELINE=$mode SPECULATORS_COMPAT_KV_CACHE_BYTES=40000000000 PYTHONPATH=$PWD/src:$PWD/testbed:$SCRATCH/spec-0.4.0.1:$SITE timeout 200 python3 benchmarks/throughput.py --hidden 2048 --layers 8 \
      --batch 32 --prompt-len 512 1024 2048 --reps 5 --max-model-len 4096 --no-native --out "$OUT/throughput_h200_shim_pipeline$mode.json" \
      > "$OUT/throughput_h200_shim_pipeline$mode.log" 2>&1; echo "shim pipeline=$mode rc=$?"
  done
fi
if [[ " $STEPS " == *" hook "* ]]; then
  echo "== per-layer hook overhead (CPU tensors on the host's cores, then CUDA tensors)"
  for d in cpu cuda; do
    PYTHONPATH=$PWD/src:$PWD/testbed:$SITE timeout 200 python3 benchmarks/hook_overhead.py --calls 5000 --reps 21 --device $d \
      --out "$OUT/hook_overhead_h200host_$d.json" > "$OUT/hook_overhead_$d.log" 2>&1; echo "hook $d rc=$?"
  done
fi
if [[ " $STEPS " == *" nopin "* ]]; then
  echo "== throughput with SPECULATORS_COMPAT_PIN=0 (pageable exchange buffers)"
  SPECULATORS_COMPAT_PIN=0 SPECULATORS_COMPAT_KV_CACHE_BYTES=40000000000 PYTHONPATH=$PWD/src:$PWD/testbed:$SCRATCH/spec-0.4.0.1:$SITE timeout 300 python3 benchmarks/throughput.py --hidden 2048 --layers 8 \
    --batch 32 --prompt-len 1024 --reps 5 --max-model-len 4096 --out "$OUT/throughput_h200_nopin.json" \
    > "$OUT/throughput_h200_nopin.log" 2>&1; echo "bench nopin rc=$?"
fi
echo "total $(( $(date +%s) - t0 ))s"
# the device tool returns at most 8 files (in name order): the logs packed first ("0_logs.tgz", so a
# failed cell's log always comes back), then the JSONs
(cd "$OUT" && tar czf 0_logs.tgz *.log && rm -f *.log)
