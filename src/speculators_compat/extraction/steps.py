"""The step loop: vLLM's engine-core step, driven by hand, one or two batches in flight.

Each step is ``EngineCore.step`` (schedule, execute_model, sample_tokens where split,
update_from_output) plus the capture's placement RPC. Where the executor takes ``non_block``
futures two batches are in flight, like ``step_with_batch_queue``; otherwise (or with
``SPECULATORS_COMPAT_PIPELINE=0``) depth 1. Details: docs/MODULES.md.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future

from . import protocol
from .errors import ExtractionError, context, fail

CLOCK_KEYS = ("schedule", "submit", "wait", "update_from_output")


def executor_takes_futures(executor_cls) -> bool:
    """True where ``execute_model``, ``sample_tokens`` and ``collective_rpc`` all take
    ``non_block`` (vLLM's FutureWrapper queue: replies are read in submission order)."""
    from ..patches._signatures import accepts

    return all(
        callable(getattr(executor_cls, name, None)) and accepts(getattr(executor_cls, name), "non_block")
        for name in ("execute_model", "sample_tokens", "collective_rpc")
    )


def pipeline_depth(executor) -> int:
    """Batches kept in flight: 2 where the executor takes futures, else 1;
    ``SPECULATORS_COMPAT_PIPELINE=0`` forces 1 (blocking calls)."""
    from .. import settings

    if not settings.flag("SPECULATORS_COMPAT_PIPELINE"):
        return 1
    if getattr(executor, "uses_ray", False) and protocol.fence_supported(executor) is not None:
        # vLLM's legacy Ray executor: shim RPCs travel as actor tasks, model steps through a
        # compiled graph, with no order between the two (a step's placement could overtake the
        # previous forward). RayExecutorV2 shares MultiprocExecutor's one ordered queue.
        return 1
    return 2 if executor_takes_futures(type(executor)) else 1


def placement(so, computed) -> dict:
    """The capture's row placement for one scheduled batch, {req_id: (tokens, computed before)};
    advances ``computed`` (the scheduler advanced its own count when it scheduled)."""
    step = {}
    for rid, n in so.num_scheduled_tokens.items():
        if rid not in computed:
            raise ExtractionError(f"the scheduler scheduled unknown request {rid!r}\n[{context()}]")
        step[rid] = (n, computed[rid])
        computed[rid] += n
    return step


def stuck(scheduler) -> ExtractionError:
    return ExtractionError(
        f"the scheduler scheduled nothing with {scheduler.get_num_unfinished_requests()} request(s) "
        f"unfinished (KV cache too small for the longest sequence?)\n[{context()}]"
    )


def _done(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class Batch:
    __slots__ = ("so", "seq", "f_step", "f_exec", "f_sample", "what")

    def __init__(self, so, seq, f_step, f_exec, f_sample, what):
        self.so, self.seq, self.f_step, self.f_exec, self.f_sample, self.what = so, seq, f_step, f_exec, f_sample, what


def submit(executor, so, step, clock, what, timeout, futures: bool) -> Batch:
    """Send one batch: the capture placement, execute_model, and sample_tokens where a batch
    with tokens defers its output to it. With ``futures`` nothing waits here."""
    seq = protocol.next_seq()
    t0 = time.perf_counter()
    try:
        if futures:
            f_step = executor.collective_rpc(protocol.RPC_NAME, args=(seq, protocol.STEP, step), timeout=timeout, non_block=True)
            f_exec = executor.execute_model(so, non_block=True)
            # An empty batch (it only carries finished ids) gives its output from execute_model,
            # as in vLLM's EngineCore; a batch with tokens defers it to sample_tokens.
            f_sample = executor.sample_tokens(None, non_block=True) if so.total_num_scheduled_tokens else None
        else:
            f_step = _done(executor.collective_rpc(protocol.RPC_NAME, args=(seq, protocol.STEP, step), timeout=timeout))
            protocol.values(protocol.STEP, seq, f_step.result())
            output = executor.execute_model(so)
            if output is None and callable(getattr(executor, "sample_tokens", None)):
                output = executor.sample_tokens(None)  # 0.11.1+: execute_model defers sampling
            f_exec, f_sample = _done(output), None
    except ExtractionError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise fail(what, exc, executor) from exc
    clock["submit"] += time.perf_counter() - t0
    return Batch(so, seq, f_step, f_exec, f_sample, what)


def complete(executor, scheduler, batch: Batch, clock) -> None:
    """Wait for the oldest batch in flight and hand its output to the scheduler."""
    t0 = time.perf_counter()
    try:
        replies = batch.f_step.result()
        output = batch.f_exec.result()
        sampled = batch.f_sample.result() if batch.f_sample is not None else None
    except Exception as exc:  # noqa: BLE001
        raise fail(batch.what, exc, executor) from exc
    protocol.values(protocol.STEP, batch.seq, replies)
    if output is None:
        output = sampled
    if output is None:
        raise ExtractionError(
            f"{batch.what} failed: execute_model and sample_tokens both returned None "
            f"({batch.so.total_num_scheduled_tokens} tokens scheduled)\n[{context()}]"
        )
    t1 = time.perf_counter()
    try:
        scheduler.update_from_output(batch.so, output)
    except Exception as exc:  # noqa: BLE001
        raise fail(batch.what, exc, executor) from exc
    clock["wait"] += t1 - t0
    clock["update_from_output"] += time.perf_counter() - t1


def drive(executor, scheduler, req_ids, clock, depth: int, timeout: float, idle=None):
    """Step until every request finished: ({req_id: tokens computed}, steps). With futures,
    ``idle()`` runs once while the first batch computes (host work that needs no result)."""
    futures = depth > 1
    computed = dict.fromkeys(req_ids, 0)
    iterations = 0
    for key in CLOCK_KEYS:
        clock.setdefault(key, 0.0)
    inflight: deque = deque()
    while True:
        while len(inflight) < depth and scheduler.has_unfinished_requests():
            t0 = time.perf_counter()
            so = scheduler.schedule()
            clock["schedule"] += time.perf_counter() - t0
            if so.total_num_scheduled_tokens == 0:
                # Nothing to schedule until a batch in flight returns. Ids finished by an earlier
                # update ride on this output: the workers must see them, so it is sent.
                if getattr(so, "finished_req_ids", None):
                    inflight.append(submit(executor, so, {}, clock, f"engine step {iterations} (finished ids)", timeout, futures))
                break
            iterations += 1
            inflight.append(submit(executor, so, placement(so, computed), clock, f"engine step {iterations}", timeout, futures))
        if not inflight:
            if scheduler.has_unfinished_requests():
                raise stuck(scheduler)
            break
        if idle is not None and futures:
            t0 = time.perf_counter()
            idle()
            idle = None
            clock["idle"] = time.perf_counter() - t0
        complete(executor, scheduler, inflight.popleft(), clock)
    deliver_finished(executor, scheduler, clock, timeout, futures)
    return computed, iterations


def deliver_finished(executor, scheduler, clock, timeout, futures) -> None:
    """Send the last finished request ids to the workers (an empty batch), if any."""
    for key in CLOCK_KEYS:
        clock.setdefault(key, 0.0)
    so = scheduler.schedule()
    if so.total_num_scheduled_tokens == 0 and getattr(so, "finished_req_ids", None):
        complete(executor, scheduler, submit(executor, so, {}, clock, "engine cleanup step", timeout, futures), clock)
    elif so.total_num_scheduled_tokens:
        raise ExtractionError(
            f"engine cleanup step: the scheduler scheduled {so.total_num_scheduled_tokens} tokens of requests "
            f"this call does not own\n[{context()}]"
        )
