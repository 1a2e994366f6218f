"""Fault injection on the real generator: bad input, and a vLLM worker killed or stuck mid-``generate``.

    python -m speculators_compat.testing.fault_runner --out result.json [--fault kill|stop] [--timeout 60]

Builds the tiny Llama, starts speculators' ``VllmHiddenStatesGenerator`` on the installed vLLM,
runs one good call, then bad inputs (each must be a one-line ValueError, and the next good call
must give identical states), then starts a call whose batch needs several scheduler steps and
SIGKILLs (dead worker) or SIGSTOPs (stuck worker) every vLLM worker process just before the
engine's second step. Nothing of vLLM or speculators
is replaced: the fault is a real dead process. Records what the caller sees (exception type,
message, seconds until it surfaced, against ``SPECULATORS_COMPAT_RPC_TIMEOUT``) and which of this
process's descendants are still alive right after the error and after the executor's shutdown
(orphans). The e2e test asserts on this JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback


def descendants(root: int | None = None) -> list[dict]:
    """Live descendant processes of ``root`` (default: this process), from /proc."""
    root = os.getpid() if root is None else root
    parent_of, info = {}, {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
        except (OSError, ValueError):
            continue
        if fields[0] == "Z":  # zombie: exited, waiting to be reaped
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:300]
        except OSError:
            cmdline = ""
        parent_of[int(pid)] = int(fields[1])
        info[int(pid)] = (name, cmdline)
    out = []
    for pid in parent_of:
        p = pid
        while p in parent_of and p != root:
            p = parent_of[p]
        if p == root and pid != root:
            name, cmdline = info[pid]
            out.append({"pid": pid, "name": name, "cmdline": cmdline, "helper": _is_helper(cmdline)})
    return sorted(out, key=lambda d: d["pid"])


def _is_helper(cmdline: str) -> bool:
    """Python's multiprocessing resource tracker / forkserver: they exit with their parent."""
    return "multiprocessing.resource_tracker" in cmdline or "multiprocessing.forkserver" in cmdline


def orphans() -> list[dict]:
    return [d for d in descendants() if not d["helper"]]


def run(args) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["SPECULATORS_COMPAT_RPC_TIMEOUT"] = str(args.timeout)
    # engine steps are bounded by vLLM's own execute_model timeout (default 300 s)
    os.environ["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] = str(int(args.timeout))
    sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}[args.fault]
    import speculators_compat
    from speculators_compat.testing import tiny_models

    for key, value in tiny_models.vllm_env("llama", "cpu").items():
        os.environ.setdefault(key, value)
    result: dict = {
        "rpc_timeout_s": args.timeout,
        "fault": f"{sig.name} every vLLM worker before engine step 2",
    }
    model_dir = tiny_models.build_tiny_model("llama", num_layers=4, hidden_size=128)
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

    from speculators_compat.versions import installed_versions

    result["versions"] = {k: v.version for k, v in installed_versions().items()}
    gen = VllmHiddenStatesGenerator(str(model_dir), layer_ids=[1, 2, 3], max_model_len=2048)
    good = gen.generate([[5, 6, 7, 8] * 10])
    result["warm_call_ok"] = len(good) == 1 and good[0]["hidden_states"][0].shape[0] == 40
    # bad input: a one-line error before anything is scheduled; the generator stays usable
    vocab = gen.vllm_config.model_config.get_vocab_size()
    result["bad_input"] = {}
    for name, batch in (
        ("empty sequence", [[5, 6, 7], []]),
        ("token id out of vocabulary", [[5, 6, vocab + 3]]),
        ("negative token id", [[-2, 6]]),
        ("non-integer token id", [[5, 6.5]]),
    ):
        try:
            gen.generate(batch)
            result["bad_input"][name] = None
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            result["bad_input"][name] = {"type": type(exc).__name__, "message": str(exc)}
    again = gen.generate([[5, 6, 7, 8] * 10])
    import torch

    result["after_bad_input_identical"] = all(
        torch.equal(a, b) for a, b in zip(good[0]["hidden_states"], again[0]["hidden_states"])
    )
    # vLLM names its worker processes (setproctitle "VLLM::Worker..."); older builds leave "python"
    named = [d["pid"] for d in orphans() if "VLLM" in d["name"] or "Worker" in d["name"]]
    workers = named or [d["pid"] for d in orphans()]
    result["processes_before"] = descendants()

    executor = gen.executor
    original = executor.execute_model
    calls = {"n": 0}

    def execute_model(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            for d in descendants():
                if d["pid"] in workers:
                    try:
                        os.kill(d["pid"], sig)
                    except ProcessLookupError:
                        pass
            result["killed"] = workers
        return original(*a, **kw)

    executor.execute_model = execute_model
    batch = [[(7 * i + j) % 900 + 4 for j in range(1900)] for i in range(6)]  # > 8192 tokens: several steps
    t0 = time.perf_counter()
    try:
        gen.generate(batch)
        result["error"] = None
    except BaseException as exc:  # noqa: BLE001 - the outcome under test
        result["error"] = {
            "type": type(exc).__name__,
            "message": str(exc),
            "traceback": traceback.format_exc(),
        }
    result["seconds_to_error"] = time.perf_counter() - t0
    result["steps_started"] = calls["n"]
    time.sleep(1.0)
    result["alive_after_error"] = descendants()
    result["workers_alive_after_error"] = [d for d in orphans() if d["pid"] in workers]
    t1 = time.perf_counter()
    try:
        executor.shutdown()
        result["shutdown"] = "ok"
    except BaseException as exc:  # noqa: BLE001
        result["shutdown"] = f"{type(exc).__name__}: {exc}"
    deadline = time.time() + 30
    while orphans() and time.time() < deadline:
        time.sleep(0.5)
    result["shutdown_s"] = time.perf_counter() - t1
    result["alive_after_shutdown"] = descendants()
    result["orphans_after_shutdown"] = orphans()
    result["patches"] = [r["id"] for r in speculators_compat.report() if r["status"] == "applied"]
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="SPECULATORS_COMPAT_RPC_TIMEOUT and VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS for this run",
    )
    p.add_argument("--fault", choices=("kill", "stop"), default="kill", help="SIGKILL (dead) or SIGSTOP (stuck) the workers")
    args = p.parse_args(argv)
    from speculators_compat.testing.provenance import provenance, scrub_paths

    prov = provenance()
    result = run(args)
    result = {"provenance": prov, **scrub_paths(json.loads(json.dumps(result, default=str)))}
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
