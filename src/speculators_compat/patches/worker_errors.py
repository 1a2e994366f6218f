"""Worker start failures with their cause, in the caller's exception.

A vLLM worker that fails to start logs its traceback in its own process; the caller gets only
"WorkerProc initialization failed ...". The patches record the worker's exception (type,
message, frame) at vLLM's own ``logger.exception`` in a private folder, and the caller's
``MultiprocExecutor._init_executor`` raises vLLM's exception ending with each worker's cause.
Anything else passes unchanged. Details: docs/MODULES.md.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback

from ..registry import Call, Patch, wrapper_patch
from ._signatures import EXECUTOR as MULTIPROC, bind_problem, import_attr

FOLDER_ENV = "SPECULATORS_COMPAT_WORKER_CAUSES"  # the caller's folder for this start, read by its workers
START_FAILED = "WorkerProc failed to start"  # vLLM's log line in worker_main
INIT_FAILED = "WorkerProc initialization failed"  # vLLM's exception in wait_for_ready
HEADER = "Causes recorded by the workers (speculators-compat):"
_START_LOCK = threading.Lock()  # starts in one process take turns (one folder in the environment)


def _new_lock_in_child() -> None:  # a child forked while another thread held it would deadlock
    global _START_LOCK
    _START_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_in_child)


def _short_path(path: str) -> str:
    marker = f"{os.sep}site-packages{os.sep}"
    return path.split(marker, 1)[1] if marker in path else os.path.basename(path)


def describe(exc: BaseException) -> str:
    """``module.Type: message at file:line in function`` (the innermost Python frame)."""
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ in ("builtins", "__main__") else f"{kind.__module__}.{kind.__qualname__}"
    text = " ".join(str(exc).split()) or repr(exc)
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {_short_path(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    return f"{name}: {text}{where}"


def record_cause(folder: str, exc: BaseException) -> None:
    """Write this worker's cause into ``folder`` (atomically: a reader never sees half a file)."""
    proc = multiprocessing.current_process()
    entry = {"worker": proc.name, "pid": os.getpid(), "cause": describe(exc)}
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".cause-")
    with os.fdopen(fd, "w") as fh:
        json.dump(entry, fh)
    os.replace(tmp, os.path.join(folder, f"cause-{os.getpid()}.json"))


def read_causes(folder: str) -> list[dict]:
    """The causes recorded in ``folder``, in rank order (unreadable or malformed records skipped)."""
    out = []
    for name in sorted(os.listdir(folder)):
        if name.startswith("cause-") and name.endswith(".json"):
            try:
                with open(os.path.join(folder, name)) as fh:
                    entry = json.load(fh)
            except (OSError, ValueError):
                continue
            if isinstance(entry, dict) and {"worker", "pid", "cause"} <= set(entry):
                out.append(entry)
    return sorted(out, key=lambda e: (_rank(e["worker"]), e["pid"]))


def _rank(worker: str) -> int:
    tail = worker.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 1 << 30


class CauseRecordingLogger:
    """vLLM's module logger, plus: at the start-failure log line, the cause goes to the folder."""

    def __init__(self, logger: logging.Logger):
        self._logger = logger

    def exception(self, msg, *args, **kwargs):
        folder = os.environ.get(FOLDER_ENV)
        exc = sys.exc_info()[1]
        if folder and exc is not None and isinstance(msg, str) and msg.startswith(START_FAILED):
            try:
                record_cause(folder, exc)
            except Exception:  # noqa: BLE001 - never in the way of vLLM's own handling
                pass
        kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1  # the log line keeps vLLM's call site
        return self._logger.exception(msg, *args, **kwargs)

    def __getattr__(self, name):
        if name == "_logger":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self._logger, name)


def _build_logger(current):
    return CauseRecordingLogger(current)


# CauseRecordingLogger.exception's call of vLLM's logger (bound by the probe against vLLM's own
# logger: once applied, the module's logger is the shim's, which takes anything)
LOG_CALL = Call(MULTIPROC, "logger.exception", args=("msg",), kwargs=("stacklevel",))


def _probe_logger(current):
    if not callable(getattr(current, "exception", None)):
        return f"expected {MULTIPROC}.logger with exception(); found {current!r}"
    problem = bind_problem(LOG_CALL, current.exception)
    if problem:
        return problem
    worker_main = getattr(import_attr(MULTIPROC, "WorkerProc"), "worker_main", None)
    from .engine_options import _code_constants, _code_names

    if worker_main is None or "logger" not in _code_names(worker_main):
        return "expected WorkerProc.worker_main to log through the module logger; not found"
    if not any(c.startswith(START_FAILED) for c in _code_constants(worker_main)):
        return f"expected WorkerProc.worker_main to log {START_FAILED!r} on a failed start; not found"
    return None


def with_causes(exc: BaseException, causes: list[dict]) -> BaseException:
    """vLLM's exception, same type, its message ending with the workers' causes."""
    lines = [f"{str(exc).rstrip()}", HEADER] + [f"  {c['worker']} (pid {c['pid']}): {c['cause']}" for c in causes]
    try:
        new = type(exc)("\n".join(lines))
    except Exception:  # noqa: BLE001 - a type that takes other arguments: a note instead
        if hasattr(exc, "add_note"):
            exc.add_note("\n".join(lines[1:]))
        return exc
    new.__cause__ = exc.__cause__
    new.__suppress_context__ = exc.__suppress_context__
    return new


def _init_executor_with_causes(wrapped, instance, args, kwargs):
    with _START_LOCK:
        try:
            folder = tempfile.mkdtemp(prefix="speculators-compat-worker-start-")  # 0700
        except OSError:
            return wrapped(*args, **kwargs)  # vLLM's own start, as it is
        previous = os.environ.get(FOLDER_ENV)
        os.environ[FOLDER_ENV] = folder
        try:
            return wrapped(*args, **kwargs)
        except Exception as exc:
            if INIT_FAILED not in str(exc):
                raise
            try:
                causes = read_causes(folder)
                if not causes:
                    time.sleep(0.2)  # a worker's record lands before its pipe closes; others may trail
                    causes = read_causes(folder)
                new = with_causes(exc, causes) if causes else None
            except Exception:  # noqa: BLE001 - vLLM's own exception, as it was
                new = None
            if new is None or new is exc:
                raise
            raise new.with_traceback(exc.__traceback__) from exc.__cause__
        finally:
            if previous is None:
                os.environ.pop(FOLDER_ENV, None)
            else:
                os.environ[FOLDER_ENV] = previous
            shutil.rmtree(folder, ignore_errors=True)


def _probe_init_executor(current):
    wait = getattr(import_attr(MULTIPROC, "WorkerProc"), "wait_for_ready", None)
    from .engine_options import _code_constants

    if wait is None or not any(c.startswith(INIT_FAILED) for c in _code_constants(wait)):
        return f"expected WorkerProc.wait_for_ready to raise {INIT_FAILED!r}...; not found"
    return None


PATCHES = [
    Patch(
        id="worker-start-cause-record",
        family="execution",
        hook_module=MULTIPROC,
        attribute="logger",
        build=_build_logger,
        probe=_probe_logger,
    ),
    wrapper_patch(
        "worker-start-cause-raise",
        "execution",
        MULTIPROC,
        "MultiprocExecutor._init_executor",
        _init_executor_with_causes,
        _probe_init_executor,
        requires=("worker-start-cause-record",),
    ),
]
