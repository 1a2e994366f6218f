"""A vLLM worker that cannot start names its cause in the caller's exception (real vLLM).

A tiny model whose weights file has a corrupt header: the worker fails in vLLM's weight loader.
Without the shim's worker-start-cause patches the caller gets only vLLM's "WorkerProc
initialization failed ... See stack trace for root cause"; with them, vLLM's exception (same
type) ends with the worker's recorded cause: worker, pid, type, message and frame. Both worker
start methods (fork, spawn), TP 1 and 2, and the control with the patches left out.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

pytest.importorskip("vllm")
pytest.importorskip("speculators")

SCRIPT = r"""
import json, sys
import speculators_compat
from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator
if __name__ == "__main__":
    try:
        VllmHiddenStatesGenerator(sys.argv[1], layer_ids=[1, 2], tensor_parallel_size=int(sys.argv[2]))
        out = {"error": None}
    except BaseException as exc:
        out = {"error": {"type": f"{type(exc).__module__}.{type(exc).__qualname__}", "message": str(exc)}}
    print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def corrupt_model(tmp_path_factory):
    from speculators_compat_testbed import build_tiny_model

    src = build_tiny_model("llama")
    dst = tmp_path_factory.mktemp("corrupt") / "llama-corrupt"
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[:8] = (2**62).to_bytes(8, "little")  # a header length no file has
    weights.write_bytes(bytes(data))
    return dst


def _start(tmp_path, model, method: str, tp: int = 1, patches: str | None = None) -> dict:
    script = tmp_path / "start.py"
    script.write_text(SCRIPT)
    env = {"VLLM_WORKER_MULTIPROC_METHOD": method, "VLLM_CPU_KVCACHE_SPACE": "1"}
    if tp == 2:  # CPU vLLM binds each worker's threads to its own cores (test_generator's TP=2 cell)
        env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    if patches is not None:
        env["SPECULATORS_COMPAT_PATCHES"] = patches

    proc = subprocess.run([sys.executable, str(script), str(model), str(tp)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **env})
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, f"no result (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(line[7:])["error"]


@pytest.mark.parametrize("method, tp", [
    ("spawn", 1), ("fork", 1),
    pytest.param("spawn", 2, marks=pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="TP=2 on CPU vLLM needs two cores")),
])
def test_the_cause_reaches_the_caller(tmp_path, corrupt_model, method, tp):
    err = _start(tmp_path, corrupt_model, method, tp)
    assert err is not None, "the generator started on a corrupt weights file"
    assert err["type"] == "builtins.Exception", err  # vLLM's own type
    msg = err["message"]
    assert msg.startswith("WorkerProc initialization failed"), msg
    assert "Causes recorded by the workers (speculators-compat):" in msg, msg
    cause = msg.split("(speculators-compat):", 1)[1]
    assert "VllmWorker-0 (pid " in cause, msg
    assert "SafetensorError" in cause and "header" in cause.lower(), msg
    assert " at " in cause and ".py:" in cause, msg  # the frame it rose in


def test_without_the_patches_the_message_is_bare(tmp_path, corrupt_model):
    err = _start(tmp_path, corrupt_model, "spawn", patches="-worker-start-cause-record,-worker-start-cause-raise")
    assert err is not None and err["message"].startswith("WorkerProc initialization failed"), err
    assert "Causes recorded" not in err["message"] and "SafetensorError" not in err["message"], err
