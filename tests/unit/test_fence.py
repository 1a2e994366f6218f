"""protocol.fence's own bookkeeping: how long it waits for each reply and what it says when one
never comes. The executor is a stand-in holding only what fence touches (futures_queue,
response_mqs, collective_rpc); the real executor's fence runs in tests/e2e/test_faults.py."""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future

import pytest

from speculators_compat.extraction import protocol
from speculators_compat.extraction.errors import ExtractionError


class Queue:
    """One worker's reply queue: stale replies, each after ``delay`` s, then the fence's (unless ``silent``)."""

    def __init__(self, stale: int, delay: float, silent: bool = False):
        self.stale, self.delay, self.silent, self.fence_seq = stale, delay, silent, None
        self.timeouts = []  # what each read was allowed

    def dequeue(self, timeout=None):
        self.timeouts.append(timeout)
        if self.stale:
            wait = self.delay
            reply = {"ok": True, "seq": -1, "value": None}
            self.stale -= 1
        elif self.silent:
            wait, reply = float("inf"), None
        else:
            wait, reply = self.delay, {"ok": True, "seq": self.fence_seq, "value": None}
        if timeout is not None and wait > timeout:
            time.sleep(timeout)
            raise TimeoutError
        time.sleep(wait)
        return 0, reply


class Executor:
    def __init__(self, queues, queued: int):
        self.response_mqs = queues
        self.futures_queue = deque(Future() for _ in range(queued))

    def collective_rpc(self, method, args=(), timeout=None, non_block=False):
        assert method == protocol.RPC_NAME and args[1] == protocol.FENCE and non_block
        for q in self.response_mqs:
            q.fence_seq = args[0]
        future = Future()
        self.futures_queue.append(future)
        return future


def test_each_reply_may_take_the_timeout_however_many_come_before_it():
    # 3 stale replies 0.1 s apart on rank 0: 0.4 s in all, twice the 0.2 s timeout, none over it
    executor = Executor([Queue(3, 0.1), Queue(0, 0.0)], queued=2)
    assert protocol.fence(executor, 0.2) == 3
    assert not executor.futures_queue  # the abandoned futures and the fence's own are gone


def test_a_silent_worker_is_named_with_what_it_sent_and_what_was_abandoned():
    executor = Executor([Queue(0, 0.0), Queue(1, 0.0, silent=True)], queued=2)
    with pytest.raises(ExtractionError) as err:
        protocol.fence(executor, 0.2)
    # every read was allowed the timeout itself, not a share of a total or one scaled by the queued RPCs
    assert [t for q in executor.response_mqs for t in q.timeouts] == [0.2, 0.2, 0.2]
    msg = str(err.value)
    assert "expected rank 1's reply to fence #" in msg and "found 1 stale reply from it, then none for 0.2s" in msg, msg
    assert "2 queued RPC(s) abandoned" in msg, msg
