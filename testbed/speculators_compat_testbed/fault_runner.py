"""Fault injection on the real generator: bad input, and a vLLM worker killed or stuck mid-``generate``.

    python -m speculators_compat_testbed.fault_runner --out result.json [--fault kill|stop] [--timeout 60]

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


def _outcome(exc) -> dict:
    return {"type": type(exc).__name__, "message": str(exc)}


def _same(a, b) -> bool:
    import torch

    return len(a) == len(b) and all(
        len(x["hidden_states"]) == len(y["hidden_states"])
        and all(torch.equal(p, q) for p, q in zip(x["hidden_states"], y["hidden_states"]))
        for x, y in zip(a, b)
    )


def _on_workers(gen, fn):
    """Run ``fn(worker)`` in every vLLM worker (vLLM pickles the function)."""
    return gen.executor.collective_rpc(fn)


def _arm_skip_rows(worker):
    """Worker side: the next step's first copy (one span, or spans merged into one) is not made
    (rows lost in this call)."""
    state = worker._speculators_compat_capture
    original = type(state)._copy_rows

    def copy_rows(slot, stream):
        copies = state.copies
        state.copies = [c[1:] for c in copies]
        try:
            original(state, slot, stream)
        finally:
            state.copies = copies
        if slot == len(state.layer_ids) - 1:
            del state._copy_rows  # once: back to the class's method

    state._copy_rows = copy_rows
    return True


def _arm_step_error(worker):
    """Worker side: the next placement RPC raises (an exception inside a real vLLM worker)."""
    state = worker._speculators_compat_capture

    def set_step(step):
        del state.set_step
        raise ValueError("injected fault in the worker's set_step")

    state.set_step = set_step
    return True


PLANTED = ("batch_order", "_copy_rows", "on_layer_output", "compute_spans")


def _arm_plant(worker, mode):
    """Worker side: plant a wrong answer the written-rows check cannot see, until disarmed.
    ``order``: the step's requests in reverse order (rows go to another sequence of the same
    length); ``shift``: every captured row is the next token's; ``no_residual``: the layers'
    hidden states without the residual (another stream); ``early``: a prompt's later chunks
    placed one row early (counts stay right)."""
    import torch

    from speculators_compat.layers import LayerAdapter

    state = worker._speculators_compat_capture
    cls = type(state)
    if mode == "order":
        state.batch_order = lambda: list(reversed(cls.batch_order(state)))
    elif mode == "shift":
        state._copy_rows = lambda slot, stream: cls._copy_rows(state, slot, torch.roll(stream, -1, 0))
    elif mode == "no_residual":
        state.on_layer_output = lambda lid, adapter, module, output: cls.on_layer_output(
            state, lid, LayerAdapter("planted", lambda o: o[0], adapter.required), module, output)
    elif mode == "early":
        state.compute_spans = lambda: [(s, rid, d - 1 if d > 0 else d, n) for s, rid, d, n in cls.compute_spans(state)]
    else:
        raise ValueError(f"unknown plant {mode!r}")
    return True


def _disarm_plant(worker):
    state = worker._speculators_compat_capture
    for name in PLANTED:
        state.__dict__.pop(name, None)
    return True


def run_recover(args, result: dict) -> dict:
    """Faults the generator must survive on ONE engine: after each, the next call gives states
    identical to a clean call (or, where it cannot, a one-line error on every later call).
    ``result`` is filled as the battery goes, so a battery cut short still reports its cases."""
    import resource
    import threading

    import speculators_compat
    from speculators_compat.extraction.errors import ExtractionError
    from speculators_compat_testbed import tiny_models

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["SPECULATORS_COMPAT_RPC_TIMEOUT"] = str(args.timeout)
    for key, value in tiny_models.vllm_env("llama", "cpu").items():
        os.environ.setdefault(key, value)
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

    from speculators_compat.versions import installed_versions

    result.update(versions={k: v.version for k, v in installed_versions().items()}, cases={},
                  rpc_timeout_s=args.timeout)
    model_dir = tiny_models.build_tiny_model("llama", num_layers=4, hidden_size=128)
    gen = VllmHiddenStatesGenerator(str(model_dir), layer_ids=[1, 2, 3], max_model_len=4096)
    # several scheduler steps (> max_num_batched_tokens), more than ten sequences
    batch = [[(7 * i + j) % 900 + 4 for j in range(300 + 97 * i)] for i in range(12)]
    clean = gen.generate(batch)
    result["steps_per_call"] = gen._speculators_compat_timings.get("iterations")
    result["driver"] = gen._speculators_compat_timings.get("driver")

    def case(name, action):
        entry: dict = {}
        t0 = time.perf_counter()
        try:
            action()
            entry["error"] = None
        except BaseException as exc:  # noqa: BLE001 - the outcome under test
            entry["error"] = _outcome(exc)
        entry["seconds"] = round(time.perf_counter() - t0, 3)
        try:
            after = gen.generate(batch)
            entry["next_call_identical"] = _same(after, clean)
        except BaseException as exc:  # noqa: BLE001
            entry["next_call_identical"] = False
            entry["next_call_error"] = _outcome(exc)
        result["cases"][name] = entry
        print(f"fault case {name}: {entry}", file=sys.stderr, flush=True)

    # 1. Ctrl-C while the caller waits for a worker's reply, at each read of a call: the reply
    #    stays queued (the desynchronised queue a naive retry would misread)
    mq = gen.executor.response_mqs[0]
    reads = {"n": 0}
    original_dequeue = mq.dequeue

    def counting(*a, **kw):
        reads["n"] += 1
        return original_dequeue(*a, **kw)

    mq.dequeue = counting
    gen.generate(batch)
    per_call = reads["n"]
    del mq.dequeue
    result["reply_reads_per_call"] = per_call
    for k in range(1, per_call + 1):
        def interrupt_at(k=k):
            seen = {"n": 0}

            def dequeue(*a, **kw):
                seen["n"] += 1
                if seen["n"] == k:
                    del mq.dequeue
                    raise KeyboardInterrupt(f"injected at reply read {k}")
                return original_dequeue(*a, **kw)

            mq.dequeue = dequeue
            try:
                gen.generate(batch)
            finally:
                mq.__dict__.pop("dequeue", None)

        case(f"interrupt_at_read_{k}", interrupt_at)

    # 2. a worker writes fewer rows than scheduled (one span lost): the written-rows check fires
    def lost_rows():
        _on_workers(gen, _arm_skip_rows)
        gen.generate(batch)

    case("rows_not_written", lost_rows)

    # 3. an exception raised inside a real vLLM worker reaches the caller whole
    def worker_raises():
        _on_workers(gen, _arm_step_error)
        gen.generate(batch)

    case("worker_exception", worker_raises)

    # 4. a re-run of the capture set-up with a bad layer id must leave the capture as it was
    def bad_setup():
        keep = gen.layer_ids
        gen.layer_ids = [1, 99]
        try:
            gen._setup_capture()
        finally:
            gen.layer_ids = keep

    case("setup_rerun_bad_layer", bad_setup)

    # 5. exchange memory really full: the kernel refuses the file size (RLIMIT_FSIZE), in a call
    #    that needs a new chunk
    big = batch * 12  # > the 64 MiB chunk the pool holds: a new chunk is needed

    def memory_full():
        import signal as _signal

        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        old = _signal.signal(_signal.SIGXFSZ, _signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
        try:
            gen.generate(big)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            _signal.signal(_signal.SIGXFSZ, old)

    case("exchange_memory_full", memory_full)

    # 6. two threads call generate at once: serialised, both right
    outs: dict = {}

    def worker_thread(name):
        try:
            outs[name] = _same(gen.generate(batch), clean)
        except BaseException as exc:  # noqa: BLE001
            outs[name] = _outcome(exc)

    def two_threads():
        threads = [threading.Thread(target=worker_thread, args=(n,)) for n in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        result["two_threads"] = outs
        if outs != {"a": True, "b": True}:
            raise ExtractionError(f"concurrent calls: {outs}")

    case("two_threads", two_threads)

    # 7. the self-check: wrong answers planted in the worker, which the written-rows check cannot
    #    see, fail the call (SelfCheckFailed); with the self-check off the same plant returns wrong
    #    rows silently (the control: the plant really is wrong, and the check is what catches it)
    same_len = [[(11 * i + 3 * j) % 900 + 4 for j in range(64)] for i in range(6)]
    clean_same = gen.generate(same_len)
    result["self_check_before_plants"] = dict(getattr(gen, "_speculators_compat_self_check", None) or {})

    def planted(mode, rows=None):
        def action():
            old = os.environ.get("SPECULATORS_COMPAT_SELF_CHECK_ROWS")
            if rows is not None:
                os.environ["SPECULATORS_COMPAT_SELF_CHECK_ROWS"] = str(rows)
            gen.executor.collective_rpc(_arm_plant, args=(mode,))
            try:
                got = gen.generate(same_len)
                result.setdefault("planted_returned_identical", {})[f"{mode}/{rows}"] = _same(got, clean_same)
            finally:
                gen.executor.collective_rpc(_disarm_plant)
                if rows is not None:
                    if old is None:
                        os.environ.pop("SPECULATORS_COMPAT_SELF_CHECK_ROWS", None)
                    else:
                        os.environ["SPECULATORS_COMPAT_SELF_CHECK_ROWS"] = old
        return action

    for mode in ("order", "shift", "no_residual"):
        case(f"planted_{mode}", planted(mode))
        case(f"planted_{mode}_check_off", planted(mode, rows=0))
    # the clean batch (several steps: prompts prefilled in chunks), later chunks placed one row early

    def early(rows=None):
        def action():
            old = os.environ.get("SPECULATORS_COMPAT_SELF_CHECK_ROWS")
            if rows is not None:
                os.environ["SPECULATORS_COMPAT_SELF_CHECK_ROWS"] = str(rows)
            gen.executor.collective_rpc(_arm_plant, args=("early",))
            try:
                got = gen.generate(batch)
                result.setdefault("planted_returned_identical", {})[f"early/{rows}"] = _same(got, clean)
            finally:
                gen.executor.collective_rpc(_disarm_plant)
                if rows is not None:
                    if old is None:
                        os.environ.pop("SPECULATORS_COMPAT_SELF_CHECK_ROWS", None)
                    else:
                        os.environ["SPECULATORS_COMPAT_SELF_CHECK_ROWS"] = old
        return action

    case("planted_early", early())
    case("planted_early_check_off", early(rows=0))
    result["self_check"] = getattr(gen, "_speculators_compat_self_check", None)
    result["patches"] = [r["id"] for r in speculators_compat.report() if r["status"] == "applied"]
    try:
        gen.executor.shutdown()
    except Exception:  # noqa: BLE001
        pass
    return result


def run(args, result: dict) -> dict:
    if args.fault == "recover":
        return run_recover(args, result)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["SPECULATORS_COMPAT_RPC_TIMEOUT"] = str(args.timeout)
    # engine steps are bounded by vLLM's own execute_model timeout (default 300 s)
    os.environ["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] = str(int(args.timeout))
    sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}[args.fault]
    import speculators_compat
    from speculators_compat_testbed import tiny_models

    for key, value in tiny_models.vllm_env("llama", "cpu").items():
        os.environ.setdefault(key, value)
    result.update(rpc_timeout_s=args.timeout, fault=f"{sig.name} every vLLM worker before engine step 2")
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
    try:  # a later call must say, in one line, that this generator cannot be used
        gen.generate([[5, 6, 7, 8] * 10])
        result["later_call"] = None
    except BaseException as exc:  # noqa: BLE001 - the outcome under test
        result["later_call"] = {"type": type(exc).__name__, "message": str(exc)}
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
    # every call checked: a plant must meet the check on the call it is planted in
    os.environ.setdefault("SPECULATORS_COMPAT_SELF_CHECK_BUDGET", "1")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="SPECULATORS_COMPAT_RPC_TIMEOUT and VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS for this run",
    )
    p.add_argument(
        "--fault",
        choices=("kill", "stop", "recover"),
        default="kill",
        help="SIGKILL (dead) or SIGSTOP (stuck) the workers; recover: the battery of faults the generator must survive",
    )
    args = p.parse_args(argv)
    from speculators_compat_testbed.provenance import provenance, scrub_paths

    prov = provenance()
    result: dict = {}
    try:
        run(args, result)
    except BaseException as exc:  # noqa: BLE001 - a battery cut short still reports what it saw
        result["aborted"] = _outcome(exc)
        traceback.print_exc()
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
