"""The saver process: data files written from the exchange's shared memory, outside the driver.

The driver describes each sample (a tensor in an exchange chunk by its chunk, byte range, dtype,
shape and strides; a small tensor by its bytes) and never copies it; the saver maps the chunk
read-only through ``/proc/<driver>/fd/<fd>`` (identity checked), rebuilds the same tensors and
writes, hashes and renames the file with ``output.save_tensor_file`` on its own threads, so no
pickling, writing or hashing holds the driver's GIL. Frames on the saver's own pipes: 8-byte
length + pickle. It says READY once torch is imported, and ends at the end of its requests
(the driver done, or gone: then without finishing what it holds).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import select
import stat
import struct
import subprocess
import sys
import threading
import warnings
import weakref
from pathlib import Path

READY = b"READY speculators-compat-saver 1"
READY_S = 120.0  # how long the saver may take to import torch
INLINE_MAX = 4 << 20  # a tensor outside the exchange travels as bytes up to this size (else: not described)
_PIPE_BYTES = 1 << 20  # asked-for pipe capacity (a batch's requests without waiting for the saver)


class SaverGone(RuntimeError):
    """The saver process did not start, or ended with requests open."""


class NotShared(Exception):
    """A sample the saver cannot take (it is then saved by the driver)."""


class _T(tuple):
    """A described tensor: (storage key, source, start, nbytes, dtype, size, stride, storage
    offset); tensors of one storage share its key (torch.save writes that storage once), and
    only the first carries the source."""


class _Same(int):
    """The n-th tensor described before, again (the same object: pickled once, as torch.save does)."""


# -- the driver's side ---------------------------------------------------------------------------


def describe(obj, locate):
    """``obj`` with each tensor replaced by a ``_T`` (storage key, source, start, nbytes, dtype,
    size, stride, storage offset): source a chunk's (fd, dev, ino, size) from ``locate(ptr, nbytes)``, or the storage's
    bytes when small; None where any part cannot be described (another type, a large tensor not in
    the exchange, a tensor on a device or with autograd)."""
    import ctypes

    import torch

    seen: set = set()
    order: dict = {}  # id(tensor) -> its number, for a tensor met again

    def walk(x):
        if type(x) is dict:
            return {k: walk(v) for k, v in x.items()}
        if type(x) in (list, tuple):
            return type(x)(walk(v) for v in x)
        if x is None or type(x) in (bool, int, float, str):
            return x
        if type(x) is not torch.Tensor or x.layout != torch.strided or x.device.type != "cpu" \
                or x.requires_grad or x.is_quantized or x.is_conj() or x.is_neg():
            raise NotShared
        if id(x) in order:
            return _Same(order[id(x)])
        order[id(x)] = len(order)
        storage = x.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        key = (ptr, nbytes) if nbytes else ("empty", len(order))  # empty storages are each their own
        place = None
        if key in seen:
            source, start = None, 0
        elif nbytes and (place := locate(ptr, nbytes)) is not None:
            source, start = place
        elif nbytes <= INLINE_MAX:
            source, start = ctypes.string_at(ptr, nbytes) if nbytes else b"", 0
        else:
            raise NotShared
        seen.add(key)
        return _T((key, source, start, nbytes, str(x.dtype).removeprefix("torch."), tuple(x.shape), x.stride(),
                   x.storage_offset()))

    try:
        return walk(obj)
    except NotShared:
        return None


def _write_frame(fd: int, payload: bytes) -> None:
    message = memoryview(struct.pack("<Q", len(payload)) + payload)
    while message:
        message = message[os.write(fd, message):]


def _read_exact(fd: int, n: int) -> bytes | None:
    parts, need = [], n
    while need:
        chunk = os.read(fd, min(need, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        need -= len(chunk)
    return b"".join(parts)


def _read_frame(fd: int) -> bytes | None:
    head = _read_exact(fd, 8)
    if head is None:
        return None
    return _read_exact(fd, struct.unpack("<Q", head)[0])


class Saver:
    """One saver process with ``workers`` threads. ``on_reply(key, (size, sha) or exception)``
    runs on this object's reader thread for each request; ``on_lost(keys, why)`` once, with the
    requests still open, where the process ended early or could not start (no reply after it)."""

    def __init__(self, workers: int, on_reply, on_lost):
        self._on_reply, self._on_lost = on_reply, on_lost
        self._lock = threading.Lock()  # _open, failure
        self._writing = threading.Lock()  # the request pipe (held across a write, never with _lock)
        self._open: set = set()  # keys sent and not answered
        self.failure: str | None = None
        req_r, self._req = os.pipe()
        self._rep, rep_w = os.pipe()
        for fd in (self._req, self._rep):
            with contextlib.suppress(OSError, AttributeError):
                import fcntl

                fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
        package_root = str(Path(__file__).resolve().parent.parent)  # last on its path: found there if not before
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _MAIN, package_root, str(workers), str(os.getpid()), str(rep_w)],
                stdin=req_r, pass_fds=(rep_w,), start_new_session=True)
        except BaseException:
            os.close(self._req)
            os.close(self._rep)
            raise
        finally:
            os.close(req_r)
            os.close(rep_w)
        self.fds = [self._req, self._rep]  # emptied once closed (a forked child closes its copies)
        self._finalizer = weakref.finalize(self, _end, self.proc, self.fds)
        _LIVE.add(self)
        self._reader = threading.Thread(target=self._read_replies, name="speculators-compat-saver-replies",
                                        daemon=True)
        self._reader.start()

    def send(self, key, path: Path, fsync: bool, description, live: list) -> None:
        """Hand one file to the saver; SaverGone where it has ended (the caller saves it itself)."""
        payload = pickle.dumps((key, os.path.abspath(path), fsync, description, live), protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            if self.failure is not None:
                raise SaverGone(self.failure)
            self._open.add(key)
        try:
            with self._writing:
                if self._req not in self.fds:
                    raise OSError(0, "closed")
                _write_frame(self._req, payload)
        except OSError as exc:
            with self._lock:
                if key not in self._open:  # already handed to on_lost
                    return
                self._open.discard(key)
            raise SaverGone(self.failure or f"the saver process ended ({exc.strerror})") from None

    def _read_replies(self) -> None:
        why = None
        try:
            poller = select.poll()
            poller.register(self._rep, select.POLLIN)
            if not poller.poll(READY_S * 1000):
                why = f"the saver process did not start within {READY_S:.0f} s"
            else:
                first = _read_frame(self._rep)
                if first != READY:
                    why = (f"{sys.executable} did not start the saver (exit code {self.proc.poll()})"
                           if first is None else f"the saver process answered {first[:60]!r}")
            while why is None:
                frame = _read_frame(self._rep)
                if frame is None:
                    break
                key, error, result = pickle.loads(frame)
                with self._lock:
                    self._open.discard(key)
                self._on_reply(key, _rebuild_error(error) if error else result)
        except Exception as exc:  # noqa: BLE001 - told to on_lost, never raised on this thread
            why = f"{type(exc).__name__}: {exc}"
        if why is not None and self.proc.poll() is None:
            self.proc.kill()  # a saver out of step: a send blocked on it returns (EPIPE)
        with self._lock:
            lost, self._open = sorted(self._open, key=repr), set()
            self.failure = why or f"the saver process ended (exit code {self.proc.poll()})"
        with self._writing:
            self._close_fd(self._req)
            self._close_fd(self._rep)
        _wait(self.proc)
        if lost or why:
            self._on_lost(lost, self.failure)

    def _close_fd(self, fd: int) -> None:  # under self._writing
        if fd in self.fds:
            self.fds.remove(fd)
            os.close(fd)

    def close(self) -> None:
        """Ends the saver: the end of its requests (it exits; killed after 10 s), then its last
        replies read."""
        with self._writing:
            self._close_fd(self._req)
        _wait(self.proc)
        if self._reader is not threading.current_thread():
            self._reader.join()


def _wait(proc: subprocess.Popen) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _end(proc: subprocess.Popen, fds: list) -> None:
    while fds:
        with contextlib.suppress(OSError):
            os.close(fds.pop())
    _wait(proc)


def _forget_in_child() -> None:
    """A forked child closes its copies of the savers' pipes (a saver must see its driver end)."""
    for saver in list(_LIVE):
        saver._finalizer.detach()
        while saver.fds:
            with contextlib.suppress(OSError):
                os.close(saver.fds.pop())
    _LIVE.clear()


_LIVE: weakref.WeakSet = weakref.WeakSet()
os.register_at_fork(after_in_child=_forget_in_child)


def _rebuild_error(error: tuple) -> BaseException:
    """The saver's error as the driver raises it: an OSError (of its builtin class) keeps its
    class, errno and text; anything else is a RuntimeError naming its class."""
    import builtins

    kind, errno, text = error
    if kind == "NotShared":
        return NotShared(text)
    cls = getattr(builtins, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, OSError)):
        return RuntimeError(f"{kind}: {text}")
    exc = cls(text)
    exc.errno = errno or None
    return exc


# -- the saver's side ---------------------------------------------------------------------------


def _map(caller: int, source: tuple, maps: dict):
    fd_number, dev, ino, size = source
    if (dev, ino) in maps:
        return maps[(dev, ino)]
    path = f"/proc/{caller}/fd/{fd_number}"
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino, st.st_size) != (dev, ino, size):
            raise NotShared(f"{path} is not the exchange chunk the driver described")
        maps[(dev, ino)] = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return maps[(dev, ino)]


def _rebuild(description, caller: int, maps: dict):
    import torch

    storages: dict = {}
    built: list = []

    def walk(x):
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, _T):
            key, source, start, nbytes, dtype, size, stride, offset = x
            if source is None:
                storage = storages[key]
            elif isinstance(source, bytes):
                storage = torch.frombuffer(bytearray(source), dtype=torch.uint8).untyped_storage() if nbytes \
                    else torch.UntypedStorage(0)
            else:
                storage = torch.frombuffer(_map(caller, source, maps), dtype=torch.uint8, count=nbytes,
                                           offset=start).untyped_storage()
            storages[key] = storage
            built.append(torch.empty(0, dtype=getattr(torch, dtype)).set_(storage, offset, size, stride))
            return built[-1]
        if isinstance(x, _Same):
            return built[x]
        if isinstance(x, tuple):
            return tuple(walk(v) for v in x)
        return x

    return walk(description)


_MAIN = "import sys; sys.path.append(sys.argv[1]); from speculators_compat import saver; saver.main()"


def main() -> None:
    """The saver process (``_MAIN`` PACKAGE_ROOT WORKERS DRIVER_PID REPLY_FD): requests on stdin."""
    from concurrent.futures import ThreadPoolExecutor

    import torch  # noqa: F401 - imported before READY: the first request waits for nothing

    from . import output

    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    workers, caller, out = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    lock = threading.Lock()
    maps: dict = {}

    def reply(key, error, result) -> None:
        payload = pickle.dumps((key, error, result), protocol=pickle.HIGHEST_PROTOCOL)
        with lock:
            _write_frame(out, payload)

    def save(key, path: str, fsync: bool, obj) -> None:
        try:
            result = output.save_tensor_file(obj, Path(path), fsync, digest=output._digest)
        except BaseException as exc:  # noqa: BLE001 - every outcome is the driver's to judge
            reply(key, (type(exc).__name__, getattr(exc, "errno", None) or 0, str(exc) or repr(exc)), None)
        else:
            reply(key, None, result)

    _write_frame(out, READY)
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="speculators-compat-saver") as pool:
        while (frame := _read_frame(0)) is not None:
            key, path, fsync, description, live = pickle.loads(frame)
            for dead in [k for k in maps if k not in live]:  # chunks the driver has let go
                with contextlib.suppress(BufferError):
                    maps.pop(dead).close()
            try:
                obj = _rebuild(description, caller, maps)
            except (OSError, NotShared, RuntimeError, ValueError, TypeError) as exc:
                reply(key, ("NotShared", 0, f"{type(exc).__name__}: {exc}"), None)
                continue
            pool.submit(save, key, path, fsync, obj)
            del obj
        os._exit(0)  # the driver closed its end: with requests open it is gone, and nothing is finished
