"""A child process on two pipes of its own (the save path's checksum helpers and saver process).

``req`` is the child's stdin; ``rep`` its stdout, or with ``reply_arg`` a descriptor whose number
ends its argv. ``close()``, garbage collection or exit closes this side's ends (the child exits at
the end of its input) and waits for it, killing it after ``wait_s``. A forked copy of this process
closes its copies of the ends and leaves the child alone: a child must see its own parent end.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import weakref


class PipedChild:
    def __init__(self, argv: list[str], *, reply_arg: bool = False, pipe_bytes: int = 0, wait_s: float = 5.0,
                 **popen):
        req_r, req = os.pipe()
        rep, rep_w = os.pipe()
        if pipe_bytes:
            for fd in (req, rep):
                with contextlib.suppress(OSError, AttributeError, ImportError):
                    import fcntl

                    fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, pipe_bytes)
        reply = {"pass_fds": (rep_w,)} if reply_arg else {"stdout": rep_w}
        try:
            self.proc = subprocess.Popen([*argv, str(rep_w)] if reply_arg else argv, stdin=req_r,
                                         start_new_session=True, **reply, **popen)
        except BaseException:
            os.close(req)
            os.close(rep)
            raise
        finally:
            os.close(req_r)
            os.close(rep_w)
        self.req, self.rep = req, rep
        self.fds = [req, rep]  # this side's open ends: emptied once closed
        self._finalizer = weakref.finalize(self, end, self.proc, self.fds, wait_s)
        _LIVE.add(self)

    def close(self) -> None:
        self._finalizer()


def wait(proc: subprocess.Popen, seconds: float) -> None:
    """Waits ``seconds`` for ``proc``, then kills it."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=seconds)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def end(proc: subprocess.Popen, fds: list, wait_s: float) -> None:
    while fds:
        with contextlib.suppress(OSError):
            os.close(fds.pop())
    wait(proc, wait_s)


def _forget_in_child() -> None:
    for child in list(_LIVE):
        child._finalizer.detach()
        while child.fds:
            with contextlib.suppress(OSError):
                os.close(child.fds.pop())
    _LIVE.clear()


_LIVE: weakref.WeakSet = weakref.WeakSet()  # the children of this process
os.register_at_fork(after_in_child=_forget_in_child)
