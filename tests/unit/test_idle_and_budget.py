"""Two driver policies, mechanics only (real vLLM: tests/e2e): ``drive`` runs its ``idle`` work once,
after the first batches are in flight and before the first is waited for (never on the serial
driver); ``selfcheck.due`` checks the first call, then only while the checked calls' timed work,
doubled, stays within the budget's share of all calls' time."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from speculators_compat.extraction import selfcheck, steps

pytestmark = pytest.mark.unit


def _done(value):
    f: Future = Future()
    f.set_result(value)
    return f


class _Executor:
    def __init__(self, log):
        self.log = log

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False):
        self.log.append("submit")
        replies = [{"seq": args[0], "ok": True, "value": None}]
        return _done(replies) if non_block else replies

    def execute_model(self, so, non_block=False):
        return _done(None) if non_block else None

    def sample_tokens(self, grammar, non_block=False):
        out = SimpleNamespace(outputs=True)
        return _done(out) if non_block else out


class _Scheduler:
    """Three steps of one request, 4 tokens each."""

    def __init__(self, log):
        self.log, self.left, self.done = log, 3, 0

    def has_unfinished_requests(self):
        return self.done < 3

    def schedule(self):
        if self.left:
            self.left -= 1
            return SimpleNamespace(total_num_scheduled_tokens=4, num_scheduled_tokens={"r": 4}, finished_req_ids=set())
        return SimpleNamespace(total_num_scheduled_tokens=0, num_scheduled_tokens={}, finished_req_ids=set())

    def update_from_output(self, so, output):
        self.log.append("complete")
        self.done += 1


@pytest.mark.parametrize("depth", [1, 2])
def test_idle_runs_once_between_the_first_submits_and_the_first_wait(depth):
    log: list = []
    clock: dict = {}
    computed, n = steps.drive(_Executor(log), _Scheduler(log), ["r"], clock, depth, 5.0,
                              idle=lambda: log.append("idle"))
    assert computed == {"r": 12} and n == 3
    if depth == 2:
        assert log[:4] == ["submit", "submit", "idle", "complete"] and log.count("idle") == 1, log
        assert clock["idle"] >= 0
    else:
        assert "idle" not in log and "idle" not in clock  # the serial driver builds after, as before


def test_the_first_call_is_always_checked():
    assert selfcheck.due(None, 0.005)
    assert selfcheck.due({"calls": 1, "checked_calls": 0, "call_s": 1.0, "check_s": 0.0}, 0.005)


@pytest.mark.parametrize("check_s, call_s, due", [
    (0.002, 1.0, True),      # 2 x 2 ms within 0.5 % of 1 s
    (0.003, 1.0, False),     # 2 x 3 ms over 5 ms
    (0.003, 1.2, True),
])
def test_later_calls_while_the_doubled_check_time_is_within_the_share(check_s, call_s, due):
    tally = {"calls": 5, "checked_calls": 1, "call_s": call_s, "check_s": check_s}
    assert selfcheck.due(tally, 0.005) is due


def test_budget_one_checks_every_call():
    assert selfcheck.due({"calls": 9, "checked_calls": 9, "call_s": 1.0, "check_s": 1.0}, 1.0)


def test_the_share_checked_converges_to_the_budget():
    """A run of calls of 150 ms whose check (timed work 1.9 ms, the H200's) would cost 2 % on every
    call: the budget keeps the doubled estimate within 0.5 %, so under 1 % in fact."""
    tally = {"calls": 0, "checked_calls": 0, "call_s": 0.0, "check_s": 0.0}
    for _ in range(2000):
        checked = selfcheck.due(tally, 0.005)
        tally["calls"] += 1
        tally["call_s"] += 0.150
        if checked:
            tally["checked_calls"] += 1
            tally["check_s"] += 0.0019
    assert 0.004 <= 2 * tally["check_s"] / tally["call_s"] <= 0.0051
    assert 0.15 < tally["checked_calls"] / tally["calls"] < 0.25
