"""The saver process: data files written from the exchange's shared memory, outside the driver.

The driver describes each sample (a tensor in an exchange chunk by its chunk, byte range, dtype,
shape and strides; a small tensor by its bytes) and never copies it; the saver maps that range
read-only through ``/proc/<driver>/fd/<fd>`` (identity checked), rebuilds the same tensors and
writes the file under its temporary name (``output.write_tensor_file``; SHA-256 by a checksum
helper per thread, as in the driver) on its own threads, so no pickling, writing or hashing
holds the driver's GIL. The driver renames it (only
the holder of the folder's lock places files). Frames on the saver's own pipes: 8-byte length +
pickle. It says READY once torch is imported, and ends at the end of its requests or any error.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import select
import stat
import struct
import sys
import threading
import warnings
from pathlib import Path

from . import child
from .child import PipedChild

READY = b"READY speculators-compat-saver 2 " + os.fsencode(os.path.realpath(__file__))  # this very file
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
    """``obj`` with each tensor replaced by a ``_T``: source a chunk's (fd, dev, ino, size) from
    ``locate(ptr, nbytes)``, or the storage's bytes when small; None where any part cannot be
    described (another type, a large tensor not in the exchange, a device or autograd tensor)."""
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


class Saver(PipedChild):
    """One saver process with ``workers`` threads. ``on_reply(key, (tmp, size, sha) or exception)``
    runs on this object's reader thread for each request; ``on_lost(keys, why)`` once, with the
    requests still open, where the process ended early or could not start (no reply after it).
    Neither may raise."""

    def __init__(self, workers: int, on_reply, on_lost):
        self._on_reply, self._on_lost = on_reply, on_lost
        self._lock = threading.Lock()  # _open, failure
        self._writing = threading.Lock()  # the request pipe (held across a write, never with _lock)
        self._open: set = set()  # keys sent and not answered
        self._closing = False
        self.ready = threading.Event()  # set once the saver said READY
        self._stopped: str | None = None  # why this side stopped the saver
        self.failure: str | None = None
        package_root = str(Path(__file__).resolve().parent.parent)
        super().__init__([sys.executable, "-c", _MAIN, package_root, str(workers), str(os.getpid())],
                         reply_arg=True, pipe_bytes=_PIPE_BYTES, wait_s=10)
        self._reader = threading.Thread(target=self._read_replies, name="speculators-compat-saver-replies",
                                        daemon=True)
        self._reader.start()

    def send(self, key, path: Path, fsync: bool, description) -> None:
        """Hand one file to the saver; SaverGone where it has ended (the caller saves it itself).
        Interrupted mid-frame, the saver is stopped (its open requests go to ``on_lost``)."""
        payload = pickle.dumps((key, os.path.abspath(path), fsync, description), protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            if self.failure is not None:
                raise SaverGone(self.failure)
            self._open.add(key)
        try:
            with self._writing:
                if self.req not in self.fds:
                    raise OSError(0, "its pipe is closed")
                _write_frame(self.req, payload)
        except OSError as exc:
            with self._lock:
                if key not in self._open:  # already handed to on_lost
                    return
                self._open.discard(key)
            raise SaverGone(self.failure or f"the saver process ended ({exc.strerror or exc})") from None
        except BaseException as exc:
            self._stop(f"stopped: a request was cut short ({type(exc).__name__})")  # it would read the next one wrong
            raise

    def _stop(self, why: str) -> None:
        self._stopped = self._stopped or why
        with contextlib.suppress(OSError):
            self.proc.kill()

    def _read_replies(self) -> None:
        why = None
        try:
            poller = select.poll()
            poller.register(self.rep, select.POLLIN)
            if not poller.poll(READY_S * 1000):
                why = f"the saver process did not start within {READY_S:.0f} s"
            else:
                first = _read_frame(self.rep)
                if first == READY:
                    self.ready.set()
                elif first is None:
                    child.wait(self.proc, 10)
                    why = f"{sys.executable} did not start the saver (exit code {self.proc.poll()}; its error above)"
                else:
                    why = f"the saver process answered {first[:100]!r}, not {READY!r}"
            while why is None:
                frame = _read_frame(self.rep)
                if frame is None:
                    break
                key, error, result = pickle.loads(frame)
                self._on_reply(key, _rebuild_error(error) if error else result)
                with self._lock:
                    self._open.discard(key)
        except Exception as exc:  # noqa: BLE001 - told to on_lost, never raised on this thread
            why = f"{type(exc).__name__}: {exc}"
        if why is not None:
            self._stop(why)  # a saver out of step: a send blocked on it returns (EPIPE)
        why = self._stopped or why
        with self._writing:
            self._close_fd(self.req)
            self._close_fd(self.rep)
        child.wait(self.proc, 10)
        with self._lock:
            lost, self._open = sorted(self._open, key=repr), set()
            self.failure = why or f"the saver process ended (exit code {self.proc.poll()})"
        if lost or not self._closing:
            self._on_lost(lost, self.failure)

    def _close_fd(self, fd: int) -> None:  # under self._writing
        if fd in self.fds:
            self.fds.remove(fd)
            os.close(fd)

    def close(self, wait_s: float = 60) -> None:
        """Ends the saver: the end of its requests (it exits; killed after ``wait_s``), then its
        last replies read."""
        self._closing = True
        with self._writing:
            self._close_fd(self.req)
        child.wait(self.proc, wait_s)
        if self._reader is not threading.current_thread():
            self._reader.join(60)  # its end of the reply pipe may be held by a child forked meanwhile


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


def _map(caller: int, source: tuple, start: int, nbytes: int, maps: list) -> tuple[mmap.mmap, int]:
    """(a read-only map of the pages holding ``nbytes`` at ``start`` of the driver's chunk, the
    offset of ``start`` in it); the map is added to ``maps`` (unmapped after the save)."""
    fd_number, dev, ino, size = source
    path = f"/proc/{caller}/fd/{fd_number}"
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino, st.st_size) != (dev, ino, size) \
                or start < 0 or start + nbytes > size:
            raise NotShared(f"{path} is not the exchange chunk the driver described")
        first = start // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
        maps.append(mmap.mmap(fd, start + nbytes - first, prot=mmap.PROT_READ, offset=first))
    finally:
        os.close(fd)
    return maps[-1], start - first


def _rebuild(description, caller: int, maps: list):
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
                mapped, at = _map(caller, source, start, nbytes, maps)
                storage = torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=at).untyped_storage()
            storages[key] = storage
            built.append(torch.empty(0, dtype=getattr(torch, dtype)).set_(storage, offset, size, stride))
            return built[-1]
        if isinstance(x, _Same):
            return built[x]
        if isinstance(x, tuple):
            return tuple(walk(v) for v in x)
        return x

    return walk(description)


def _unmap(maps: list) -> None:
    for m in maps:
        with contextlib.suppress(BufferError):  # a tensor still views it: it goes with that tensor
            m.close()


_MAIN = ("import sys; sys.path.insert(0, sys.argv[1]); from speculators_compat import saver; del sys.path[0]; "
         "saver.main()")


def main() -> None:
    """The saver process (``_MAIN`` PACKAGE_ROOT WORKERS DRIVER_PID REPLY_FD): requests on stdin.
    Whatever ends its loop (the end of the requests, an error) ends the process at once: a file
    it had not answered for stays under its temporary name."""
    from concurrent.futures import ThreadPoolExecutor

    try:
        import torch  # noqa: F401 - imported before READY: the first request waits for nothing

        from . import output

        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        workers, caller, out = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
        lock = threading.Lock()

        def reply(key, error, result) -> None:
            payload = pickle.dumps((key, error, result), protocol=pickle.HIGHEST_PROTOCOL)
            with lock:
                _write_frame(out, payload)

        def save(key, path: str, fsync: bool, description) -> None:
            maps: list = []
            try:
                try:
                    obj = _rebuild(description, caller, maps)
                except (OSError, NotShared, RuntimeError, ValueError, TypeError, KeyError) as exc:
                    reply(key, ("NotShared", 0, f"{type(exc).__name__}: {exc}"), None)
                    return
                tmp, size, sha = output.write_tensor_file(obj, Path(path), fsync, output._digest_saved)
                del obj
                reply(key, None, (str(tmp), size, sha))
            except BaseException as exc:  # noqa: BLE001 - every outcome is the driver's to judge
                reply(key, (type(exc).__name__, getattr(exc, "errno", None) or 0, str(exc) or repr(exc)), None)
            finally:
                _unmap(maps)

        _write_frame(out, READY)
        pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="speculators-compat-saver")
        while (frame := _read_frame(0)) is not None:
            pool.submit(save, *pickle.loads(frame))
    except BaseException:  # noqa: BLE001 - said on stderr; the driver saves what this process did not
        import traceback

        traceback.print_exc()
        os._exit(1)
    os._exit(0)  # with requests open, the driver is gone (or out of step): nothing more is finished
