#!/usr/bin/env bash
# Run scripts/gpu_run.sh steps in priority order inside one device call, so a call cut short still
# returns what finished. Each step runs in its own folder and is packed as $OUT/<n>_<step>.tgz (the
# device returns at most 8 files); a step whose estimate no longer fits before DEADLINE_S (seconds
# from this script's start, default 570) is skipped and named. DRY=1 prints the plan only.
#
#   PLAN="rehearse_kimi-k2.5 rehearse_deepseek-v3 selfcheck capture_b128" bash scripts/gpu_plan.sh
#
# Estimates: seconds seen on an H100 at src tree 9304329 (sessions 24, 27), the first step's bundle
# install (~30 s) added by INSTALL_S. The first 8B-shape step of a machine (selfcheck, capture_b*)
# also builds that model (~120 s, in selfcheck's and job's estimates; job: the script vs the generator,
# carry .gpu/job-whl; session 28's 335 s limit ended it after its warm-up; joblong: 384 samples, the script
# with the saver process as a side V, no fresh side; jobfsync: the same scripts with every file fsynced, A V B only, JOBFSYNC_REPS reps, dd to the same disk before and after; jobreserve: A V B, 2 reps, the exchange reserved before the loop). save: the save path's
# interference benchmark, paced and unpaced, and the disk's write speed (torch only). One rehearsal per step: two engines
# starting at once on one GPU break vLLM's memory profiling (logs/s27: Kimi-K2.5 beside DeepSeek-V3).
set -uo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
JOBRESERVE_REPS=${JOBRESERVE_REPS:-2}
JOBFSYNC_REPS=${JOBFSYNC_REPS:-1}
DEADLINE_S=${DEADLINE_S:-570}
INSTALL_S=${INSTALL_S:-30}
OUT=${OUT:-${TMPDIR:-/tmp}/out}; mkdir -p "$OUT"
N192="--hidden 4096 --layers 32 --n 192 --batch-size 8 --layer-ids 2 16 29 31"  # the 384-sample job shape of joblong, jobfsync, jobreserve
declare -A EST=([e2e]=150 [hybrid]=270 [rehearse_deepseek-v3]=200 [rehearse_kimi-k2.5]=240 [selfcheck]=260 [capture_b64]=220 [capture_b128]=300 [job]=480 [joblong]=500 [jobfsync]=$((JOBFSYNC_REPS == 1 ? 380 : 520)) [jobreserve]=${JOBRESERVE_EST:-$((JOBRESERVE_REPS == 1 ? 400 : 540))} [save]=200)
step_env() {  # the gpu_run.sh settings of one step ($2: its time limit), as exports
  case $1 in
    e2e) echo "export GPU_STEPS=e2e" ;;
    hybrid) echo "export GPU_STEPS=hybrid HYBRID_ARCHS='qwen3_5 qwen3_next'" ;;
    rehearse_*) echo "export GPU_STEPS=rehearse REHEARSE_DENSE= REHEARSE_MLA=${1#rehearse_} REHEARSE_TIMEOUT=$2" ;;
    selfcheck) echo "export GPU_STEPS=selfcheck SELFCHECK_LENS=128 SELFCHECK_REPS=31 BENCH_TIMEOUT=$2" ;;
    job) echo "export GPU_STEPS=job JOB_SHAPE='--hidden 4096 --layers 32 --n 64 --batch-size 8 --layer-ids 2 16 29 31' JOB_ARGS='--inproc-sides --fresh-side' JOB_REPS=1 JOB_TIMEOUT=$(($2 - 20)) JOB_TAG=_h4096" ;;
    joblong) echo "export GPU_STEPS=job JOB_SHAPE='$N192' JOB_ARGS='--inproc-sides --saver-side' JOB_REPS=1 JOB_TIMEOUT=$(($2 - 20)) JOB_TAG=_h4096_n192" ;;
    jobfsync) echo "export GPU_STEPS=job SPECULATORS_COMPAT_OUTPUT_FSYNC=1 JOB_DD=1 JOB_SHAPE='$N192' JOB_ARGS='--saver-side' JOB_REPS=$JOBFSYNC_REPS JOB_TIMEOUT=$(($2 - 20)) JOB_TAG=_h4096_n192_fsync" ;;
    jobreserve) echo "export GPU_STEPS=job JOB_SHAPE='$N192' JOB_ARGS='${JOBRESERVE_ARGS---saver-side}' JOB_REPS=$JOBRESERVE_REPS JOB_TIMEOUT=$(($2 - 20)) JOB_TAG=_h4096_n192_reserve" ;;
    save) echo "export GPU_STEPS=save" ;;
    capture_b*) echo "export GPU_STEPS=capture32 CAPTURE_BATCHES=${1#capture_b} CAPTURE_REPS=9 CAPTURE_REPS_AT='128=41 256=25' BENCH_TIMEOUT=$2" ;;
  esac
}
PLAN=${PLAN:-rehearse_kimi-k2.5 rehearse_deepseek-v3 selfcheck capture_b128}
for step in $PLAN; do
  [ -n "${EST[$step]:-}" ] || { echo "plan: unknown step '$step' (expected one of: ${!EST[*]})"; exit 2; }
done
n=0; installed=0; dry_spent=0
for step in $PLAN; do
  n=$((n + 1))
  est=${EST[$step]}
  need=$((est + (installed ? 0 : INSTALL_S)))
  left=$((DEADLINE_S - ($(date +%s) - t0) - dry_spent))
  if [ "$need" -gt "$left" ]; then echo "plan: $step skipped (needs ~${need}s, ${left}s left)"; continue; fi
  settings=$(step_env "$step" "$est")
  echo "plan: $n $step (~${need}s of ${left}s left): $settings"
  [ "${DRY:-0}" = 1 ] && { installed=1; dry_spent=$((dry_spent + need)); continue; }
  dir="$OUT/${n}_$step"; mkdir -p "$dir"
  # the step ends before the deadline whatever happens
  (eval "$settings"; export OUT="$dir"; timeout $((left - 10)) bash scripts/gpu_run.sh > "$dir/plan_step.log" 2>&1)
  echo "plan: $step rc=$? after $(( $(date +%s) - t0 ))s"
  installed=1
  (cd "$OUT" && tar czf "${n}_$step.tgz" "${n}_$step" && rm -rf "${n}_$step")
done
echo "plan: done after $(( $(date +%s) - t0 ))s"
