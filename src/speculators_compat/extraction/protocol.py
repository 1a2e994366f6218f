"""The RPC between the shim's driver (caller) and its capture in every vLLM worker.

One entry point, ``RPC_NAME``, takes ``(seq, op, *args)``; a reply is ``{"ok", "seq", "value"}``
or a failure with the worker's type, message and traceback. The driver checks the echoed ``seq``
on every reply (``ProtocolDesync``, never misread data); ``fence`` re-synchronises the queues
after an interrupted call. Ops: begin, step, finish, abort, describe, fence.
Details: docs/MODULES.md.
"""

from __future__ import annotations

import itertools
import os
import traceback
from dataclasses import dataclass, field

from .errors import ExtractionError, context

RPC_NAME = "_speculators_compat_rpc"

BEGIN, STEP, FINISH, ABORT, DESCRIBE, FENCE = "begin", "step", "finish", "abort", "describe", "fence"
OPS = (BEGIN, STEP, FINISH, ABORT, DESCRIBE, FENCE)


class ProtocolDesync(ExtractionError):
    """A reply that is not the answer to the RPC just sent (an earlier call's reply)."""


@dataclass(frozen=True)
class ChunkRef:
    """An exchange chunk as the worker opens it: the caller's open descriptor (read through
    ``/proc/<pid>/fd/<fd>``; the file has no name) and the identity the worker must find there."""

    fd: int
    dev: int
    ino: int
    size: int


@dataclass(frozen=True)
class Begin:
    """Arguments of ``begin``: where each sequence's rows go for this call.

    ``placements[req_id] = ([(chunk_id, byte offset) for each captured layer], tokens)``: every
    layer of every sequence is its own block [tokens, hidden] (each result tensor owns its
    storage, as speculators' own tensors do).
    """

    call: int
    caller_pid: int
    new_chunks: dict = field(default_factory=dict)  # chunk id -> ChunkRef
    live_chunks: tuple = ()
    placements: dict = field(default_factory=dict)
    layers: int = 0
    hidden: int = 0
    dtype: str = "bfloat16"
    pin: bool = True
    check_rows: int = 0  # self-check: rows sampled per sampled step (0: off)


def ok(seq, value=None) -> dict:
    return {"ok": True, "seq": seq, "value": value}


def failure(seq, exc: BaseException) -> dict:
    return {
        "ok": False,
        "seq": seq,
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": traceback.format_exc(),
        "pid": os.getpid(),
    }


_seq = itertools.count(1)


def next_seq() -> int:
    return next(_seq)


def values(op: str, seq: int, replies) -> list:
    """The replies' values, in rank order; raises on a worker error or a desynchronised reply."""
    for rank, reply in enumerate(replies):
        if not isinstance(reply, dict) or reply.get("seq") != seq:
            found = reply.get("seq") if isinstance(reply, dict) else type(reply).__name__
            raise ProtocolDesync(
                f"worker RPC {op} (#{seq}) got a reply that is not its own from rank {rank} "
                f"(found {found!r}): an earlier call's reply was still queued\n[{context()}]"
            )
        if not reply.get("ok"):
            raise ExtractionError(
                f"worker RPC {op} failed on rank {rank} (pid {reply.get('pid')}): "
                f"{reply.get('type')}: {reply.get('message') or '(no message)'}\n"
                f"worker traceback:\n{reply.get('traceback')}\n[{context()}]"
            )
    return [r["value"] for r in replies]


def fence_supported(executor) -> str | None:
    """None if ``fence`` can re-synchronise this executor's reply queues, else why not."""
    queue = getattr(executor, "futures_queue", None)
    mqs = getattr(executor, "response_mqs", None)
    if queue is None or not hasattr(queue, "remove"):
        return f"{type(executor).__name__} has no futures_queue"
    if not mqs or not all(callable(getattr(mq, "dequeue", None)) for mq in mqs):
        return f"{type(executor).__name__} has no response_mqs with dequeue()"
    return None


def fence(executor, timeout: float) -> int:
    """Re-synchronise the workers' reply queues after an interrupted call: abandon every
    pending future, send a ``fence`` RPC and read each worker's queue up to its reply. Each reply
    (stale or the fence's) may take ``timeout``: the workers answer in order, and may still be
    running the interrupted call and those queued behind it. Returns how many stale replies were
    discarded. Raises ``ExtractionError`` where it cannot, saying what it waited for."""
    why = fence_supported(executor)
    if why:
        raise ExtractionError(f"cannot re-synchronise the workers' replies: {why}")
    from concurrent.futures import InvalidStateError

    queue = executor.futures_queue
    queued = 0
    while queue:
        pending = queue.pop()
        queued += 1
        if isinstance(pending, tuple):  # vLLM < 0.2x queues (future, get_response)
            pending = pending[0]
        try:
            pending.set_exception(RuntimeError("abandoned by speculators-compat after an interrupted call"))
        except InvalidStateError:
            pass
    seq = next_seq()
    future = executor.collective_rpc(RPC_NAME, args=(seq, FENCE), timeout=timeout, non_block=True)
    for item in list(queue):  # its reply is read here, below, not by the future
        if item is future or (isinstance(item, tuple) and item[0] is future):
            queue.remove(item)
    discarded = 0
    for rank, mq in enumerate(executor.response_mqs):
        stale = 0
        while True:
            try:
                _status, result = mq.dequeue(timeout=timeout)
            except TimeoutError:
                raise ExtractionError(
                    f"re-synchronising the workers' replies: expected rank {rank}'s reply to fence #{seq}; found "
                    f"{stale} stale repl{'y' if stale == 1 else 'ies'} from it, then none for {timeout:g}s "
                    f"(SPECULATORS_COMPAT_RPC_TIMEOUT; {queued} queued RPC(s) abandoned)"
                ) from None
            if isinstance(result, dict) and result.get("seq") == seq:
                break
            stale += 1
        discarded += stale
    return discarded
