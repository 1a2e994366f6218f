"""Errors of an extraction: never empty, with their origin and the shim's context."""

from __future__ import annotations

import signal

__all__ = ["ExtractionError", "GeneratorUnusable", "context", "describe_exception", "worker_health", "fail"]


class ExtractionError(RuntimeError):
    """A failure during extraction, with its type, message, origin and the shim's context."""


class GeneratorUnusable(ExtractionError):
    """An earlier call left the engine in a state the driver cannot trust (a worker died, a
    reply went missing): every later call says so instead of returning states."""


def context() -> str:
    try:
        import speculators_compat

        return speculators_compat.context_line()
    except Exception:  # noqa: BLE001
        return "speculators-compat context unavailable"


def describe_exception(exc: BaseException) -> str:
    message = str(exc)
    if not message:
        import traceback

        frames = traceback.extract_tb(exc.__traceback__)
        if frames:
            last = frames[-1]
            message = f"(no message) raised at {last.filename}:{last.lineno} in {last.name}: {last.line}"
        else:
            message = "(no message)"
    return f"{type(exc).__name__}: {message}"


def _proc_state(pid) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError, TypeError):
        return None


def worker_health(executor) -> str | None:
    """A line naming every vLLM worker process that is dead (and how it ended) or stopped."""
    dead = []
    for handle in getattr(executor, "workers", None) or []:
        proc = getattr(handle, "proc", None)
        if proc is None:
            continue
        try:
            alive = proc.is_alive()
            code = proc.exitcode
        except Exception:  # noqa: BLE001 - a handle we cannot query says nothing
            continue
        if alive:
            if _proc_state(getattr(proc, "pid", None)) in ("T", "t"):
                dead.append(f"rank {getattr(handle, 'rank', '?')} (pid {proc.pid}) is stopped (SIGSTOP / traced)")
            continue
        if code is not None and code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        dead.append(f"rank {getattr(handle, 'rank', '?')} (pid {getattr(proc, 'pid', '?')}) {how}")
    if not dead:
        return None
    return "vLLM worker process(es) not running: " + "; ".join(dead)


def fail(step: str, exc: BaseException, executor=None) -> ExtractionError:
    """The ExtractionError for ``step`` failing with ``exc`` (raise it ``from exc``)."""
    health = worker_health(executor) if executor is not None else None
    origin = f"\n{health}" if health else ""
    return ExtractionError(f"{step} failed: {describe_exception(exc)}{origin}\n[{context()}]")
