"""Crash-consistent, resumable output for speculators' data folders, and ``verify``.

A data folder holds ``data_N.pt`` files, a manifest (``speculators_compat_manifest.jsonl``) and
speculators' ``sample_lengths.json`` / ``data_config.json``. Each file is written under a hidden
temporary name in the same folder (a data file: in a hidden folder there) and renamed when
complete, a data file once its zip archive is whole; only then does the manifest gain
its line (index, tokens, layer ids, bytes, SHA-256, read back by a helper process per save thread
so no hashing holds the driver's GIL); no temporary name ends in ``pt``, the suffix
speculators' training loader collects. The manifest's first line names what
produces the data; a resume with anything else is refused in one line. ``verify`` checks a folder
against its manifest. Nothing here imports vLLM; torch only when a file is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import select
import struct
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .child import PipedChild

MANIFEST = "speculators_compat_manifest.jsonl"
LENGTHS = "sample_lengths.json"
CONFIG = "data_config.json"
FORMAT = 1
_DATA = re.compile(r"^data_(\d+)\.pt$")
_TMP_PREFIX = ".speculators_compat."


class OutputRefused(RuntimeError):
    """The folder holds data this run must not extend or overwrite (one line: the reason)."""


_LOCKS: dict[str, int] = {}  # folder -> the open descriptor holding its lock (this process's lifetime)


def lock_folder(folder: Path) -> None:
    """Hold an exclusive lock on ``folder`` until this process ends (``flock`` on the directory
    itself: no file is added, the kernel drops it at exit or kill); OutputRefused while another
    run holds it, so a second run never sweeps or overwrites a live run's files."""
    import fcntl

    key = str(Path(folder).resolve())
    if key in _LOCKS:
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OutputRefused(f"{folder}: another run is writing this folder (it holds the folder's lock); "
                            "wait for it to end or use another --output-dir") from None
    except OSError as exc:  # a file system without flock (some NFS / Lustre mounts): run unlocked, say so
        os.close(fd)
        warnings.warn(f"speculators_compat: {folder} cannot be locked ({type(exc).__name__}: {exc}); "
                      "nothing stops a second run from writing it at the same time", RuntimeWarning, stacklevel=2)
        return
    _LOCKS[key] = fd
    # a forked child (a data-loader or engine process) must not keep the lock after this process ends
    os.register_at_fork(after_in_child=lambda fd=fd: _drop_inherited(fd))


def _drop_inherited(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
    _LOCKS.clear()


def data_name(index: int) -> str:
    return f"data_{index}.pt"


def data_files(folder: Path) -> dict[int, Path]:
    """``data_N.pt`` files in ``folder`` by N (as speculators' own scripts find them)."""
    out = {}
    for p in folder.iterdir() if folder.is_dir() else ():
        m = _DATA.match(p.name)
        if m:
            out[int(m.group(1))] = p
    return out


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tmp_name(path: Path) -> Path:
    return path.with_name(f"{_TMP_PREFIX}{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


@contextlib.contextmanager
def _atomic(path: Path, fsync: bool):
    """Yields a file open for writing under a temporary name; renamed to ``path`` on success."""
    tmp = _tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        _fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes, fsync: bool = False) -> None:
    """``path`` holds either its old content or ``data``, never a part of it."""
    with _atomic(path, fsync) as f:
        f.write(data)


_BUFFER = threading.local()  # each save thread's read buffer for hashing, reused
_CGROUP_ROOT = Path("/sys/fs/cgroup")  # the cgroup v2 mount (in a container: the container's own cgroup)
_SELF_CGROUP = Path("/proc/self/cgroup")  # "0::/path" under that mount
_WRITE_FAILED = ("iostream", "unexpected pos", "file write failed")  # torch's file writer's words


def save_workers(script_workers: int) -> int:
    """Save threads for a bf16 run: the script's own count, or half the usable cores (at most 8)
    where that is more, so SHA-256 (about 0.4 GB/s a thread) keeps up with a disk of a few GB/s."""
    return max(1, script_workers, min(8, _usable_cores() // 2))


def _usable_cores() -> int:
    """Cores this process may use: its CPU affinity, within every cgroup v2 quota on its cgroup's
    path (a container's, and any nested under it)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    for cpu_max in _cpu_max_files():
        with contextlib.suppress(OSError, ValueError):
            quota, period = cpu_max.read_text().split()[:2]
            if quota != "max":
                cores = min(cores, max(1, -(-int(quota) // int(period))))
    return cores


def _cpu_max_files() -> list[Path]:
    """``cpu.max`` of this process's cgroup v2 and of each cgroup above it (up to the mount's root)."""
    relative = "/"
    with contextlib.suppress(OSError):
        for line in _SELF_CGROUP.read_text().splitlines():
            if line.startswith("0::"):
                relative = line[3:]
    folder = _CGROUP_ROOT / os.path.normpath("/" + relative).lstrip("/")
    if not folder.resolve().is_relative_to(_CGROUP_ROOT.resolve()):
        folder = _CGROUP_ROOT
    files = []
    while True:
        files.append(folder / "cpu.max")
        if folder == _CGROUP_ROOT:
            return files
        folder = folder.parent


def save_tensor_file(obj, path: Path, fsync: bool = False) -> tuple[int, str]:
    """The bytes of ``torch.save(obj, path)``, by torch's own file writer (no GIL while it copies),
    written as ``<stem>.tmp`` in a hidden folder beside ``path``, read back for SHA-256 (by this
    thread's helper process) and renamed into place; returns (bytes, sha256 hex). torch names the
    archive inside after the file name up to its last dot, so it is the one speculators' own save gives."""
    tmp, size, sha = write_tensor_file(obj, path, fsync, _digest_saved)
    place_file(tmp, path, fsync)
    return size, sha


def write_tensor_file(obj, path: Path, fsync: bool, digest) -> tuple[Path, int, str]:
    """``save_tensor_file`` up to the rename: (the whole file under its temporary name, bytes,
    sha256 hex by ``digest(path, fsync)``); nothing is left behind on an error."""
    import torch

    folder = _tmp_name(path)
    folder.mkdir(exist_ok=True)
    tmp = folder / f"{path.stem}.tmp"
    try:
        try:
            torch.save(obj, str(tmp))
        except RuntimeError as exc:  # torch's file writer: "iostream error", no errno, no path
            if not any(w in str(exc) for w in _WRITE_FAILED):
                raise
            raise OSError(f"saving {path.name} failed writing {tmp}: {exc} ({_free(folder)} free on its "
                          "file system)") from exc
        size, sha = digest(tmp, fsync)
        problem = _archive_end_problem(tmp, size)
        if problem:  # torch <= 2.9 closes the file unchecked: a lost tail raises nothing
            raise OSError(f"saving {path.name} failed: {tmp} is cut short ({problem}; {_free(folder)} free on "
                          "its file system)")
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            folder.rmdir()
        raise
    return tmp, size, sha


def place_file(tmp: Path, path: Path, fsync: bool) -> None:
    """Renames ``write_tensor_file``'s file to ``path`` (only the run holding the folder's lock
    does) and removes its hidden folder; a ``tmp`` that is not such a file of ``path`` is refused."""
    tmp, path = Path(tmp), Path(path)
    if (tmp.name != f"{path.stem}.tmp" or tmp.parent.parent != path.parent
            or not tmp.parent.name.startswith(f"{_TMP_PREFIX}{path.name}.")):
        raise OSError(f"{tmp} is not a temporary file of {path}")
    try:
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            tmp.parent.rmdir()
    if fsync:
        _fsync_dir(path.parent)


def _archive_end_problem(path: Path, size: int) -> str | None:
    """Why ``path`` (``size`` bytes) does not end as a whole zip archive does (the end record, no
    comment, its central directory where it says), or None."""
    if size < 22:
        return f"{size} bytes"
    with open(path, "rb") as f:
        f.seek(size - 22)
        end = f.read(22)
        if end[:4] != b"PK\x05\x06" or end[20:22] != b"\0\0":
            return "no end-of-archive record"
        at = int.from_bytes(end[16:20], "little")
        if at != 0xFFFFFFFF:  # else in the zip64 record
            f.seek(at)
            if at >= size - 22 or f.read(4) != b"PK\x01\x02":
                return f"no central directory at byte {at}"
    return None


def _free(folder: Path) -> str:
    try:
        st = os.statvfs(folder)
    except OSError as exc:
        return f"unknown space ({exc.strerror})"
    return f"{st.f_bavail * st.f_frsize / 1e9:.2f} GB"


# One SHA-256 reader, run here (``_digest``) and in the checksum helper, which cannot import this
# package (it runs as ``python -I -S``).
_DIGEST_SOURCE = """
def read_digest(path, fsync, buf):
    h, size = hashlib.sha256(), 0
    with open(path, "rb", buffering=0) as f:
        while k := f.readinto(buf):
            h.update(buf[:k])
            size += k
        if fsync:
            os.fsync(f.fileno())
    return size, h.hexdigest()
"""
_NAMESPACE: dict = {"hashlib": hashlib, "os": os}
exec(compile(_DIGEST_SOURCE, "<speculators_compat.output read_digest>", "exec"), _NAMESPACE)
_read_digest = _NAMESPACE["read_digest"]

# The checksum helper: a bare interpreter that reads a file back, SHA-256s it (and fsyncs it when
# asked) for one save thread, so hashing takes no time under this process's GIL. It says READY
# first; request: path length (4 bytes), fsync flag (1 byte), absolute path; reply: one line,
# "OK size hex" or "ERR errno text". It ends at the end of its input (this process gone).
_HELPER_CODE = "import hashlib, os, struct, sys\n" + _DIGEST_SOURCE + r"""
src, out, buf = sys.stdin.buffer, sys.stdout.buffer, memoryview(bytearray(1 << 22))
out.write(b"READY speculators-compat-hash 1\n")
out.flush()
while head := src.read(5):
    n, sync = struct.unpack("<IB", head)
    path = src.read(n)
    try:
        size, hexdigest = read_digest(path, sync, buf)
        out.write(b"OK %d %s\n" % (size, hexdigest.encode()))
    except OSError as e:
        out.write(b"ERR %d %s\n" % (e.errno or 0, (e.strerror or str(e)).encode(errors="replace")))
    out.flush()
"""
_READY = b"READY speculators-compat-hash 1\n"
_READY_S = 30.0  # how long a helper may take to start
_REPLY = re.compile(rb"(?:OK (\d+) ([0-9a-f]{64})|ERR (\d+) ([^\n]*))\n")


class _HelperGone(RuntimeError):
    pass


class _Helper(PipedChild):
    """One save thread's checksum helper process (``child.PipedChild``); it ends when its thread
    does, or at exit."""

    def __init__(self):
        super().__init__([sys.executable, "-I", "-S", "-c", _HELPER_CODE], stderr=subprocess.DEVNULL)
        if self._line(_READY_S) != _READY:
            self.close()
            raise _HelperGone(f"{sys.executable} -I -S did not start as a Python interpreter")

    def _line(self, timeout: float | None = None) -> bytes:
        data = b""
        poller = select.poll()  # not select(): a descriptor above 1024 is refused there
        poller.register(self.rep, select.POLLIN)
        while not data.endswith(b"\n"):
            if timeout is not None and not poller.poll(timeout * 1000):
                return data
            chunk = os.read(self.rep, 4096)
            if not chunk:
                return data
            data += chunk
        return data

    def request(self, path: Path, fsync: bool) -> re.Match:
        """The helper's reply for ``path``; an interrupted or unreadable exchange ends the helper."""
        name = os.fsencode(os.path.abspath(path))
        message = memoryview(struct.pack("<IB", len(name), int(fsync)) + name)
        try:
            while message:
                message = message[os.write(self.req, message):]
            reply = self._line()
        except BaseException:
            self.close()  # its reply, if any, must never answer the next request
            raise
        match = _REPLY.fullmatch(reply)
        if match is None:
            self.close()
            raise _HelperGone(f"the checksum helper process ended or answered {reply[:80]!r} "
                              f"(exit code {self.proc.poll()})")
        return match


_helper_broken: list[str] = []  # why helpers cannot run here (then hashing stays in this process)


def _helper() -> _Helper | None:
    """This thread's checksum helper, started on first use; None where none can run."""
    helper = getattr(_BUFFER, "helper", None)
    if helper is not None and helper.fds and helper.proc.poll() is None:
        return helper
    _BUFFER.helper = None
    if _helper_broken or not sys.executable or getattr(sys, "frozen", False):
        return None
    try:
        _BUFFER.helper = _Helper()
    except (OSError, ValueError, subprocess.SubprocessError, _HelperGone) as exc:
        _give_up(f"{sys.executable} -I -S could not start: {exc}")
    return _BUFFER.helper


def _give_up(why: str) -> None:
    if not _helper_broken:
        _helper_broken.append(why)
        warnings.warn(f"speculators-compat: data files are checksummed in this process ({why})", RuntimeWarning,
                      stacklevel=3)


def _digest_saved(path: Path, fsync: bool) -> tuple[int, str]:
    """(bytes, sha256 hex) of a just-written file, by this thread's helper process where one runs;
    a helper that dies is replaced once, then hashing stays in this process (with one warning)."""
    helper, reply = _helper(), None
    if helper is not None:
        try:
            reply = helper.request(path, fsync)
        except (_HelperGone, BrokenPipeError) as exc:
            _BUFFER.helper = None
            if getattr(_BUFFER, "helper_lost", False):
                _give_up(f"{exc}, twice")
            _BUFFER.helper_lost = True
        del helper  # an error raised below must not keep the helper alive in its traceback
    if reply is None:
        return _digest(path, fsync)
    if reply[1] is not None:
        return int(reply[1]), reply[2].decode()
    raise OSError(int(reply[3]), reply[4].decode(errors="replace"), str(path))


def _digest(path: Path, fsync: bool = False) -> tuple[int, str]:
    """(bytes, sha256 hex) of a file read through this thread's reused 4 MiB buffer (no mmap: a
    read error stays an OSError, and mounts that refuse shared maps work)."""
    buf = getattr(_BUFFER, "view", None)
    if buf is None:
        buf = _BUFFER.view = memoryview(bytearray(1 << 22))
    return _read_digest(path, fsync, buf)


def file_sha256(path: Path) -> str:
    return _digest(path)[1]


class Manifest:
    """The append-only manifest: line 1 ``{"run": ...}``, then ``{"file": ...}`` per completed
    file and ``{"data_config": ...}``. A torn last line (a crash mid-append) is cut off on open."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.path = self.folder / MANIFEST
        self.run: dict | None = None
        self.files: dict[int, dict] = {}
        self.data_config: dict | None = None
        self.self_checks: list[dict] = []
        self.torn = 0  # bytes of an incomplete last line
        self.bad_lines: list[int] = []
        self._lock = threading.Lock()
        self._fsync = False

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        m = cls(folder)
        if not m.path.exists():
            return m
        raw = m.path.read_bytes()
        end = raw.rfind(b"\n") + 1
        m.torn = len(raw) - end
        for n, line in enumerate(raw[:end].splitlines(), 1):
            try:
                rec = json.loads(line)
            except ValueError:
                m.bad_lines.append(n)
                continue
            if n == 1 and "run" in rec:
                m.run = rec["run"]
            elif "file" in rec:
                m.files[int(rec["index"])] = rec
            elif "data_config" in rec:
                m.data_config = rec["data_config"]
            elif "self_check" in rec:
                m.self_checks.append(rec["self_check"])
            else:
                m.bad_lines.append(n)
        return m

    def start(self, run: dict, fsync: bool) -> None:
        """A new manifest holding only ``run`` (written atomically)."""
        self.run, self.files, self.data_config, self._fsync = run, {}, None, fsync
        atomic_write_bytes(self.path, (json.dumps({"run": run}, sort_keys=True) + "\n").encode(), fsync)

    def reopen(self, fsync: bool) -> None:
        """Continue an existing manifest: drop a torn last line so appends start on a line."""
        self._fsync = fsync
        if self.torn:
            with open(self.path, "r+b") as f:
                f.truncate(os.path.getsize(self.path) - self.torn)
            self.torn = 0

    def append(self, record: dict) -> None:
        line = (json.dumps(record, sort_keys=True) + "\n").encode()
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            try:
                os.write(fd, line)
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if "file" in record:
                self.files[int(record["index"])] = record
            elif "data_config" in record:
                self.data_config = record["data_config"]
            elif "self_check" in record:
                self.self_checks.append(record["self_check"])

    def lengths(self) -> dict[str, int]:
        """``sample_lengths.json`` as speculators writes it: file index (str) -> tokens, in order."""
        with self._lock:
            return {str(i): self.files[i]["tokens"] for i in sorted(self.files)}


# the run fields that must match for a folder to be extended (versions only warn)
# (the model by its config.json's hash where it is a local folder, else by its name; the data by
# the preprocessed samples, not by the paths they were read from)
IDENTITY = ("format", "model_config_sha256", "seq_length", "max_samples", "seed", "assistant_pattern",
            "turn_dropout", "layer_ids", "start_idx", "num_samples", "dataset_probe", "storage")


def identity_mismatch(old: dict, new: dict) -> str | None:
    keys = IDENTITY if old.get("model_config_sha256") and new.get("model_config_sha256") else ("model", *IDENTITY)
    for key in keys:
        if old.get(key) != new.get(key):
            return f"{key}: expected {old.get(key)!r} (the folder's manifest); found {new.get(key)!r} (this run)"
    return None


def dataset_probe(input_ids_at, n: int) -> str:
    """A fingerprint of the preprocessed dataset: its size and the token ids of up to 8 evenly
    spaced samples (a different data file, seed, template or max-samples changes it)."""
    h = hashlib.sha256(str(n).encode())
    for i in sorted({(k * (n - 1)) // 7 for k in range(8)} if n else ()):
        h.update(json.dumps([int(t) for t in input_ids_at(i)]).encode())
    return h.hexdigest()[:32]


def model_config_sha256(model_path: str) -> str | None:
    cfg = Path(model_path) / "config.json"
    return file_sha256(cfg) if cfg.is_file() else None


class SaveQueue:
    """Saves on ``workers`` threads with at most ``limit_bytes`` of samples in flight (one sample
    may exceed it alone); a failed save is raised by the next ``submit`` or by ``drain``.
    ``encode(index, sample)`` (optional) gives (what is saved, extra manifest fields), on the save
    threads. With ``shared`` (a callable giving the generator's exchange pool, or None) and no
    ``encode``, samples whose tensors are in the exchange go to a saver process (``saver``); the
    rest, and every sample after that process is lost, to the threads here."""

    def __init__(self, manifest: Manifest, workers: int, limit_bytes: int, fsync: bool, on_saved=None,
                 encode=None, shared=None):
        self._manifest, self._fsync, self._on_saved = manifest, fsync, on_saved
        self._encode = encode  # (index, sample) -> (what is saved, fields for its manifest line)
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="speculators-compat-save")
        self._limit = limit_bytes
        self._cond = threading.Condition()
        self._inflight = 0
        self._pending = 0
        self._error: BaseException | None = None
        self.peak_inflight = 0
        self.saved = 0
        self.saved_by_saver = 0
        self.blocked_s = 0.0  # time submit() waited for room (the disk or the encoding behind)
        self.at_drain: tuple[int, int, float] | None = None  # (bytes, files) still saving when drain began; its seconds
        self._shared, self._saver = shared, None
        self._live: dict[int, tuple] = {}  # every sample submitted and not finished: finishing takes it out
        self._sent: dict[int, Path] = {}  # samples with the saver: the absolute path their file goes to
        self.saver_failure: str | None = None
        self._drained = False
        self.uses_saver = shared is not None and encode is None  # asked for (it may not have started)
        if self.uses_saver:
            from . import saver

            try:
                self._saver = saver.Saver(max(1, workers), self._replied, self._lost)
            except Exception as exc:  # noqa: BLE001 - the threads here save instead, as before
                self._saver_lost(f"{sys.executable} could not start: {type(exc).__name__}: {exc}")

    def submit(self, index: int, name: str, obj: dict, tokens: int, layer_ids: list[int]) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in obj["hidden_states"])
        if index in self._live:
            raise ValueError(f"{name}: already being saved")
        with self._cond:
            t = time.perf_counter()
            while self._error is None and self._inflight and self._inflight + nbytes > self._limit:
                self._cond.wait()
            self.blocked_s += time.perf_counter() - t
            self._raise()
            self._inflight += nbytes
            self._pending += 1
            self.peak_inflight = max(self.peak_inflight, self._inflight)
        job = (index, name, obj, tokens, layer_ids, nbytes)
        self._live[index] = job
        handed = False
        try:
            if self._saver is not None and self.saver_failure is None:
                handed = self._to_saver(self._saver, index, name, obj)
            if not handed:
                self._to_threads(job)
                handed = True
        finally:
            if not handed:  # interrupted before the hand-off (a save queued anyway still runs; its end is then a no-op)
                self._finish(index, None, counted=False)

    def _to_saver(self, to, index: int, name: str, obj: dict) -> bool:
        """True where the saver (or the threads here, should it end) now has the sample."""
        from . import saver

        try:
            pool = self._shared()
            description = saver.describe(obj, pool.locate) if pool is not None else None
        except Exception as exc:  # noqa: BLE001 - a fault in describing: the threads here save, said once
            self._saver_lost(f"describing a sample failed: {type(exc).__name__}: {exc}")
            return False
        if description is None:
            return False
        target = Path(os.path.abspath(self._manifest.folder / name))
        self._sent[index] = target
        try:
            to.send(index, target, self._fsync, description)
        except saver.SaverGone:
            return self._sent.pop(index, None) is None  # else this thread hands it on
        return True

    def _save(self, index, name, obj, tokens, layer_ids, nbytes) -> None:
        error = None
        try:
            extra: dict = {}
            if self._encode is not None:
                obj, extra = self._encode(index, obj)
            size, sha = save_tensor_file(obj, self._manifest.folder / name, self._fsync)
            self._record(index, name, tokens, layer_ids, size, sha, extra)
        except BaseException as exc:  # noqa: BLE001 - handed to the driver thread
            error = exc
        finally:
            del obj
            self._finish(index, error)

    def _record(self, index, name, tokens, layer_ids, size, sha, extra) -> None:
        self._manifest.append({"file": name, "index": index, "tokens": tokens, "layer_ids": layer_ids,
                               "bytes": size, "sha256": sha, **extra})
        if self._on_saved is not None:
            self._on_saved()

    def _finish(self, index: int, error: BaseException | None, counted: bool = True) -> None:
        """The end of ``index``'s save, once (a second call does nothing); its sample is let go
        (its exchange segments return to the pool)."""
        job = self._live.pop(index, None)
        if job is None:
            return
        nbytes = job[5]
        del job
        with self._cond:
            self._error = self._error or error
            self._inflight -= nbytes
            self._pending -= 1
            if self._error is None and counted:
                self.saved += 1
            self._cond.notify_all()

    def _replied(self, index, result) -> None:
        """The saver's answer for ``index`` (on its reader thread): the file placed and recorded,
        its error kept, or (a sample it could not map) the sample saved here. Never raises."""
        from . import saver

        target = self._sent.pop(index, None)
        job = self._live.get(index)
        if target is None or job is None:
            return
        if isinstance(result, saver.NotShared):  # it could not map the sample: saved here, and what follows
            self._resubmit(job)
            self._saver_lost(str(result))
            return
        error = result if isinstance(result, BaseException) else None
        try:
            if error is None:
                tmp, size, sha = result
                place_file(Path(tmp), target, self._fsync)
                self._record(index, job[1], job[3], job[4], size, sha, {})
                self.saved_by_saver += 1
        except BaseException as exc:  # noqa: BLE001 - handed to the driver thread
            error = exc
        del job
        self._finish(index, error)

    def _lost(self, indices: list, why: str) -> None:
        """The saver ended with ``indices`` open (or never started): they are saved here. Never raises."""
        for index in indices:
            job = self._live.get(index)
            if self._sent.pop(index, None) is not None and job is not None:
                self._resubmit(job)
        self._saver_lost(why)

    def _to_threads(self, job: tuple) -> None:
        index = job[0]

        def ended(future) -> None:  # a save cancelled before it began (Ctrl-C in drain) still ends, uncounted
            if future.cancelled():
                self._finish(index, None, counted=False)

        self._pool.submit(self._save, *job).add_done_callback(ended)

    def _resubmit(self, job: tuple) -> None:
        try:
            self._to_threads(job)
        except BaseException as exc:  # noqa: BLE001 - never lost: its end is an error instead (a shut pool: Ctrl-C)
            self._finish(job[0], exc.with_traceback(None))  # its frames would keep the sample alive

    def _saver_lost(self, why: str) -> None:
        if self.saver_failure is None:
            self.saver_failure = why
            with contextlib.suppress(Exception):  # under -W error: the threads here save, unwarned
                warnings.warn(f"speculators-compat: data files are written by this process ({why})",
                              RuntimeWarning, stacklevel=2)

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"saving a data file failed: {type(self._error).__name__}: {self._error}") from self._error

    def drain(self) -> None:
        """Waits for every save, ends the saver and the threads, and raises a failed save's error
        (once: a second call returns at once, also after an interrupted one)."""
        if self._drained:
            return
        try:
            with self._cond:
                t, left = time.perf_counter(), (self._inflight, self._pending)
                while self._pending:
                    self._cond.wait()
                self.at_drain = (*left, time.perf_counter() - t)
        except BaseException:  # Ctrl-C: saves not begun are dropped (a resumed run makes them), the saver ended
            self._drained = True
            self._pool.shutdown(wait=False, cancel_futures=True)
            if self._saver is not None:
                self.saver_failure = self.saver_failure or "interrupted"  # its open samples end as errors, unwarned
                self._saver.close(wait_s=0)
            raise
        self._drained = True
        if self._saver is not None:
            self._saver.close()
        self._pool.shutdown(wait=True)
        with self._cond:
            self._raise()


# -- self-check -------------------------------------------------------------------------------

CANARY_TOLERANCE = 0.1  # relative, per row: batch-composition noise in bf16 is ~1e-2; a misplaced row ~1


def canary_error(reference: dict, again: dict) -> tuple[float, str | None]:
    """(largest per-row relative error, problem or None) of a sample captured twice in different
    batches: its token ids must match and each row of each layer stay within CANARY_TOLERANCE."""
    import torch

    a_ids, b_ids = torch.as_tensor(reference["input_ids"]), torch.as_tensor(again["input_ids"])
    if not torch.equal(a_ids.cpu(), b_ids.cpu()):
        return float("inf"), f"token ids differ ({len(a_ids)} vs {len(b_ids)} tokens)"
    if len(reference["hidden_states"]) != len(again["hidden_states"]):
        return float("inf"), f"{len(reference['hidden_states'])} vs {len(again['hidden_states'])} layers"
    worst = 0.0
    for layer, (a, b) in enumerate(zip(reference["hidden_states"], again["hidden_states"])):
        if a.shape != b.shape:
            return float("inf"), f"layer {layer}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
        a32, b32 = a.float().cpu(), b.float().cpu()
        rel = (a32 - b32).norm(dim=-1) / a32.norm(dim=-1).clamp_min(1e-6)
        row = int(rel.argmax())
        worst = max(worst, float(rel[row]))
        if not float(rel[row]) <= CANARY_TOLERANCE:
            return float(rel[row]), (f"layer {layer} row {row}: relative error {float(rel[row]):.3g} > "
                                     f"{CANARY_TOLERANCE} (a sample's rows must not depend on its batch)")
    return worst, None


# -- verify ---------------------------------------------------------------------------------


class Defect:
    """One thing wrong with a data folder; ``str`` is the message."""

    def __init__(self, kind: str, name: str, detail: str):
        self.kind, self.name, self.detail = kind, name, detail

    def __str__(self) -> str:
        return f"{self.kind}: {self.name}: {self.detail}"

    def as_dict(self) -> dict:
        return {"kind": self.kind, "name": self.name, "detail": self.detail}


def verify(folder: Path, checksums: bool = True) -> tuple[dict, list[Defect]]:
    """(summary, defects) of ``folder`` against its manifest. Raises OutputRefused without one."""
    folder = Path(folder)
    if not folder.is_dir():
        raise OutputRefused(f"{folder}: not a folder")
    m = Manifest.read(folder)
    if m.run is None:
        raise OutputRefused(f"{folder}: no readable {MANIFEST} (not written by speculators-compat run)")
    defects: list[Defect] = []
    if m.bad_lines:
        defects.append(Defect("manifest", MANIFEST, f"unreadable lines {m.bad_lines[:10]}"))
    first, n = int(m.run["start_idx"]), int(m.run["num_samples"])
    expected = range(first, first + n)
    present = data_files(folder)
    layers = (m.data_config or {}).get("hidden_states", {}).get("layer_ids")
    for index in expected:
        name, rec, path = data_name(index), m.files.get(index), present.get(index)
        if rec is None:
            defects.append(Defect("missing", name, "not recorded in the manifest"
                                  + (" (a file of that name exists: incomplete or foreign)" if path else "")))
        elif path is None:
            defects.append(Defect("missing", name, "recorded in the manifest; no such file"))
        elif path.stat().st_size != rec["bytes"]:
            defects.append(Defect("truncated" if path.stat().st_size < rec["bytes"] else "size", name,
                                  f"expected {rec['bytes']} bytes; found {path.stat().st_size}"))
        elif checksums and file_sha256(path) != rec["sha256"]:
            defects.append(Defect("checksum", name, f"expected sha256 {rec['sha256'][:16]}…; found another"))
        elif layers is not None and rec.get("layer_ids") != layers:
            defects.append(Defect("layers", name, f"expected layer ids {layers}; found {rec.get('layer_ids')}"))
    for index in sorted(set(present) - set(expected)):
        defects.append(Defect("foreign", data_name(index), f"outside this run's files data_{first}..data_{first + n - 1}"))
    for p in folder.iterdir():
        if p.name.startswith(_TMP_PREFIX):
            defects.append(Defect("partial", p.name, "a temporary file of an interrupted save"))
    complete = all(i in m.files for i in expected)
    if m.run.get("writes_sample_lengths"):
        lp = folder / LENGTHS
        want = m.lengths()
        try:
            have = json.loads(lp.read_text()) if lp.exists() else None
        except ValueError:
            have = "unreadable"
        if have is None:
            if complete:
                defects.append(Defect("missing", LENGTHS, "the run is complete; no such file"))
        elif not isinstance(have, dict) or any(want.get(k) != v for k, v in have.items()):
            defects.append(Defect("lengths", LENGTHS, "entries disagree with the manifest's token counts"))
        elif complete and have != want:
            defects.append(Defect("lengths", LENGTHS, f"expected {len(want)} entries; found {len(have)}"))
    for check in m.self_checks:
        if check.get("verdict") != "pass":
            defects.append(Defect("self-check", data_name(check.get("sample", first)),
                                  f"batch {check.get('batch')}: {check.get('problem')}"))
    if complete and not (folder / CONFIG).exists():
        defects.append(Defect("missing", CONFIG, "the run is complete; no such file"))
    summary = {"folder": str(folder), "expected_files": n, "recorded_files": sum(i in m.files for i in expected),
               "complete": complete, "checksums": checksums, "model": m.run.get("model"),
               "layer_ids": layers, "seq_length": m.run.get("seq_length"),
               "versions": m.run.get("versions"), "storage": m.run.get("storage") or "as captured",
               "fp8_max_rel_error": fp8_worst(m.files.values()), "self_checks": len(m.self_checks),
               "self_check_max_error": max((c.get("max_rel_error", 0.0) for c in m.self_checks
                                            if c.get("kind") != "engine"), default=None),
               "engine_self_check_rows": sum(c.get("rows", 0) for c in m.self_checks
                                             if c.get("kind") == "engine" and c.get("verdict") == "pass"),
               "defects": len(defects)}
    return summary, defects


def fp8_worst(records) -> list[float] | None:
    """Per layer, the largest FP8 row error of the files whose error was measured (None: none was)."""
    errs = [r["fp8_rel_error"]["max"] for r in records if r.get("fp8_rel_error")]
    return [max(col) for col in zip(*errs)] if errs else None


def cmd_verify(args) -> int:
    """``speculators-compat verify DIR``: exit 0 complete and intact, 1 defects, 2 no manifest."""
    try:
        summary, defects = verify(Path(args.folder), checksums=not args.quick)
    except OutputRefused as exc:
        print(f"speculators-compat verify: {exc}", file=__import__("sys").stderr)
        return 2
    if args.json:
        print(json.dumps(dict(summary, defects=[d.as_dict() for d in defects]), indent=2))
    else:
        for d in defects[:50]:
            print(d)
        if len(defects) > 50:
            print(f"... and {len(defects) - 50} more")
        verdict = "ok" if not defects else f"{len(defects)} defect(s)"
        print(f"{summary['folder']}: {summary['recorded_files']}/{summary['expected_files']} files recorded, "
              f"{'complete' if summary['complete'] else 'incomplete'}, {summary['self_checks']} self-check(s), "
              f"{'checksums read' if summary['checksums'] else 'sizes only'}: {verdict}")
    return 0 if not defects else 1
