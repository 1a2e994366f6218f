"""Inside a test-bed env (``BED_STRICT_IMPORTS=1``, set by ``make test`` and the nox sessions for
contract/e2e) a module that cannot be imported is an ERROR, never a skip: the env was built to
run these tests, so ``pytest.importorskip("vllm")`` skipping there means a broken env, and a
run that skips everything must not exit 0. Outside the bed (a bare ``pytest`` in a dev venv)
importorskip keeps skipping.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

STRICT = os.environ.get("BED_STRICT_IMPORTS") == "1"


def _import_skip_reason(rep) -> str | None:
    lr = rep.longrepr
    text = lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr)
    return text if "could not import" in text else None


def _as_error(rep) -> None:
    why = _import_skip_reason(rep)
    if STRICT and rep.skipped and why:
        rep.outcome = "failed"
        rep.longrepr = (f"{why}\n(BED_STRICT_IMPORTS=1: in a test-bed env a failing import is an error, not a skip;"
                        " rebuild the env: python3 scripts/bed.py python --rebuild ...)")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _as_error(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _as_error(outcome.get_result())


@pytest.fixture
def ctrl_c():
    """``ctrl_c(after_s)``: SIGINT to the main thread after ``after_s``, as a Ctrl-C. Python's own
    handler is installed for the test: a run started with SIGINT ignored (a background job of a
    shell without job control) would otherwise never raise KeyboardInterrupt."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    timers = []

    def press(after_s: float) -> None:
        timers.append(threading.Timer(after_s, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)))
        timers[-1].start()

    yield press
    for t in timers:
        t.cancel()
    signal.signal(signal.SIGINT, before)
