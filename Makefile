# The two commands of the README. Both build what they need (uv, the test bed) first.
#   make demo   tiny model through speculators' real generator on real (CPU) vLLM, vs HF
#   make test   unit tests, then contract + e2e tests in the test bed's environments
PY ?= python3
DEMO_PAIR ?= --speculators 0.4.0.1 --vllm 0.32.0
# (speculators, vLLM) pairs the test target runs contract + e2e on
TEST_PAIRS ?= 0.3.0:0.16.0 0.4.0.1:0.32.0
# the pair that also runs the rehearsal tests (check --model, its second reference: ~8 min a pair on
# 2 cores); "all" runs them on every pair. Both pairs' rehearsals: benchmarks/results/rehearsal/
REHEARSAL_PAIR ?= 0.4.0.1:0.32.0
E2E_ARCHS ?= llama,qwen3,mistral
export UV_CONSTRAINT :=
export PIP_CONSTRAINT :=

# the (speculators, vLLM) pair the CPU benchmarks run on
BENCH_PAIR ?= --speculators 0.4.0.1 --vllm 0.16.0
GPU_RESULTS = benchmarks/results/gpu/throughput_h200.json benchmarks/results/gpu/throughput_h200_native_noasync.json \
	benchmarks/results/gpu/throughput_h200_shim_pipeline0.json

# make sweep: every CPU cell (noxfile.PAIRS x SWEEP_ARCHS) through the e2e runner at HEAD, then
# scripts/update_tested.py. SWEEP_JOBS cells at once (default 1: a CPU engine wants ~2 cores).
SWEEP_JOBS ?= 1
SWEEP_ARCHS ?= llama,qwen3
SWEEP_PAIRS ?=

.PHONY: demo test unit lint bed-tools dev bench sweep train-check dist-check install-check

bed-tools:
	@command -v uv >/dev/null 2>&1 || $(PY) -m pip install -q uv

dev: bed-tools
	@test -x .venv/bin/python || uv venv -q --python "$$(command -v $(PY))" .venv
	@uv pip install -q --python .venv/bin/python -e . pytest twine ruff==0.17.6 mypy==2.4.1

demo: bed-tools
	@PYBIN=$$($(PY) scripts/bed.py python $(DEMO_PAIR)) && \
	  VLLM_CPU_KVCACHE_SPACE=$${VLLM_CPU_KVCACHE_SPACE:-1} $$PYBIN -m speculators_compat demo

# ruff (rules in pyproject.toml) over the code, the tests, the scripts and the benchmarks; mypy over
# the runtime package, --strict over its core
STRICT_CORE = src/speculators_compat/registry.py src/speculators_compat/matrix.py \
	src/speculators_compat/settings.py src/speculators_compat/versions.py
lint: dev
	.venv/bin/ruff check src tests scripts benchmarks testbed noxfile.py
	.venv/bin/mypy
	.venv/bin/mypy --strict $(STRICT_CORE)

# every test under tests/unit (by directory: a test without the marker runs too), then the tested
# table must agree with the committed results
unit: lint
	.venv/bin/python -m pytest tests/unit -q
	.venv/bin/python scripts/update_tested.py --check
	.venv/bin/python scripts/check_dist.py

# the runtime wheel, the sdist and the test bed's wheel build, pass `twine check`, and the runtime
# wheel holds no test code
dist-check: dev
	.venv/bin/python scripts/check_dist.py

# README's install (CPU variant) in a fresh venv with the runtime wheel only, then README's snippet as
# written (benchmarks/results/cpu/readme_install_check.json; ~2 min once uv's cache holds the wheels)
install-check: bed-tools
	bash scripts/readme_install_check.sh

# each pair: its test files on TEST_PROCS processes (pytest-xdist, a file stays on one)
TEST_PROCS ?= 2
test: unit
	@set -e; for pair in $(TEST_PAIRS); do \
	  s=$${pair%%:*}; v=$${pair##*:}; \
	  echo "== contract + e2e: speculators $$s, vLLM $$v"; \
	  PYBIN=$$($(PY) scripts/bed.py python --speculators $$s --vllm $$v); \
	  sel="not rehearsal"; case " $(REHEARSAL_PAIR) " in *" all "*|*" $$pair "*) sel="";; esac; \
	  export BED_STRICT_IMPORTS=1 SPECULATORS_COMPAT_E2E_ARCHS=$(E2E_ARCHS) VLLM_CPU_KVCACHE_SPACE=1; \
	  $$PYBIN -m pytest tests/contract tests/e2e -q -rs --durations=40 -n $(TEST_PROCS) --dist loadfile $${sel:+-m "$$sel"}; \
	done

sweep: bed-tools
	$(PY) scripts/sweep.py --jobs $(SWEEP_JOBS) --archs $(SWEEP_ARCHS) $(if $(SWEEP_PAIRS),--pairs $(SWEEP_PAIRS))

# speculators' trainer reads the script's output (two envs: extract on vLLM 0.32, train on speculators'
# own pins; ~3 min on 2 cores, outside `make test`)
TRAIN_CHECK_WORK ?= .train-check
train-check: bed-tools
	@set -e; rm -rf $(TRAIN_CHECK_WORK); \
	  GEN=$$($(PY) scripts/bed.py python --speculators 0.4.0.1 --vllm 0.32.0); \
	  TRAIN=$$($(PY) scripts/bed.py python --speculators 0.4.0.1 --vllm none); \
	  VLLM_CPU_KVCACHE_SPACE=1 $$GEN tests/e2e/script_pipeline.py $(TRAIN_CHECK_WORK); \
	  SPECULATORS_COMPAT_STORE_DTYPE=fp8 VLLM_CPU_KVCACHE_SPACE=1 $$GEN tests/e2e/script_pipeline.py $(TRAIN_CHECK_WORK)/fp8; \
	  TRAIN_CHECK_DATA=$(abspath $(TRAIN_CHECK_WORK))/out TRAIN_CHECK_DATA_FP8=$(abspath $(TRAIN_CHECK_WORK))/fp8/out \
	    TRAIN_CHECK_OUT=$(abspath benchmarks/results/train/fp8_vs_bf16.json) $$TRAIN -m pytest -m train tests/train -q -rs -s

# CPU benchmarks on the test bed, then the plot (GPU results: scripts/gpu_run.sh, see README)
bench: dev
	.venv/bin/python benchmarks/import_cost.py --runs 40 --out benchmarks/results/import_cost.json
	@PYBIN=$$($(PY) scripts/bed.py python $(BENCH_PAIR)) && \
	  VLLM_CPU_KVCACHE_SPACE=2 $$PYBIN benchmarks/throughput.py --hidden 512 --layers 6 --batch 16 \
	    --prompt-len 128 256 --reps 5 --out benchmarks/results/cpu/throughput_cpu_vllm-0.16.json && \
	  $$PYBIN benchmarks/hook_overhead.py --calls 5000 --reps 21 --out benchmarks/results/hook_overhead.json
	@uv pip install -q --python .venv/bin/python matplotlib
	.venv/bin/python benchmarks/plot_throughput.py --out benchmarks/results/throughput.png $(GPU_RESULTS) \
	  benchmarks/results/cpu/throughput_cpu_vllm-0.16.json
