"""Exchange buffers for captured hidden states: a recycled pool of shared-memory chunks.

Workers write captured rows straight into shared memory the caller maps; the caller's result
tensors are that memory. Chunks are created, mapped and (on GPUs) page-locked once and reused: a
segment returns to the pool when the caller drops its last tensor of it; capacity grows to what
the caller keeps alive (results being saved) plus one call, the largest of the last ``WINDOW``
calls; beyond it, chunks idle for the whole window are dropped.
Details: docs/MODULES.md.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import mmap
import os
import tempfile
import uuid
import weakref

ALIGN = 4096  # segment alignment (bytes): page-aligned rows for the copies
GRAIN = 64  # keys inside a run (allocate_runs): back to back where their sizes are multiples of it
MIN_CHUNK = 64 << 20  # smallest new chunk (bytes)
WINDOW = 256  # calls whose demand the pool keeps room for; a chunk idle this long beyond it goes


class ExchangeError(RuntimeError):
    """Shared memory for captured states could not be reserved."""


def shm_dir() -> str:
    """The folder exchange chunks are made in (``SPECULATORS_COMPAT_SHM_DIR``, else /dev/shm);
    a configured folder that is missing, not a folder or not writable is one clear error."""
    from .settings import text

    configured = text("SPECULATORS_COMPAT_SHM_DIR")
    if configured:
        if not os.path.exists(configured):
            raise ExchangeError(f"SPECULATORS_COMPAT_SHM_DIR={configured!r} does not exist")
        if not os.path.isdir(configured):
            raise ExchangeError(f"SPECULATORS_COMPAT_SHM_DIR={configured!r} is not a directory")
        if not os.access(configured, os.W_OK | os.X_OK):
            raise ExchangeError(f"SPECULATORS_COMPAT_SHM_DIR={configured!r} is not writable by this process")
        return configured
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _round_up(n: int, align: int = ALIGN) -> int:
    return max(align, (n + align - 1) // align * align)


def _anonymous_file(directory: str) -> int:
    """A read-write descriptor of a file in ``directory`` that has no name (``O_TMPFILE``):
    nothing can delete, replace or leak it; it is freed when its last descriptor and mapping
    go. Where the filesystem lacks ``O_TMPFILE``, a fresh name is created and unlinked at once."""
    tmpfile = getattr(os, "O_TMPFILE", 0)
    if tmpfile:
        try:
            return os.open(directory, os.O_RDWR | tmpfile | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise ExchangeError(f"cannot create exchange memory in {directory}: {exc.strerror}") from None
    path = os.path.join(directory, f"speculators_compat_{os.getpid()}_{uuid.uuid4().hex}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise ExchangeError(f"cannot create exchange memory in {directory}: {exc.strerror}") from None
    os.unlink(path)
    return fd


class Chunk:
    """One shared-memory file, mapped in this process: a first-fit free list of segments.

    The file has no name; workers open it through this process's descriptor
    (``/proc/<pid>/fd/<fd>``) and check its identity (``ref``)."""

    def __init__(self, chunk_id: int, directory: str, size: int):
        self.id = chunk_id
        self.directory = directory
        self.size = size
        fd = _anonymous_file(directory)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise ExchangeError(
                    f"cannot reserve {size} bytes for captured states in {directory} "
                    f"({exc.strerror}); free space there or set SPECULATORS_COMPAT_SHM_DIR"
                ) from None
            self.map = mmap.mmap(fd, size)
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        self.fd: int | None = fd
        self.dev, self.ino = st.st_dev, st.st_ino
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))  # the export ends with this line
        self.view = memoryview(self.map)
        self.free = [(0, size)]  # sorted, coalesced (offset, length)
        self.leased = 0
        self.last_busy = 0  # the pool's call count when this chunk last held a lease

    def ref(self):
        from .extraction.protocol import ChunkRef

        return ChunkRef(fd=self.fd, dev=self.dev, ino=self.ino, size=self.size)

    def close(self) -> None:
        """Give the memory back (idle chunks only; workers drop their mapping at the next call)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        try:
            self.view.release()
            self.map.close()
        except BufferError:  # a tensor still views it: the mapping goes with that tensor
            pass

    def take(self, nbytes: int) -> int | None:
        for k, (off, length) in enumerate(self.free):
            if length >= nbytes:
                if length == nbytes:
                    del self.free[k]
                else:
                    self.free[k] = (off + nbytes, length - nbytes)
                self.leased += nbytes
                return off
        return None

    def give(self, off: int, nbytes: int) -> None:
        self.leased -= nbytes
        free = self.free
        lo, hi = 0, len(free)
        while lo < hi:
            mid = (lo + hi) // 2
            if free[mid][0] < off:
                lo = mid + 1
            else:
                hi = mid
        free.insert(lo, (off, nbytes))
        # coalesce with the right, then the left neighbour
        if lo + 1 < len(free) and free[lo][0] + free[lo][1] == free[lo + 1][0]:
            free[lo] = (free[lo][0], free[lo][1] + free[lo + 1][1])
            del free[lo + 1]
        if lo > 0 and free[lo - 1][0] + free[lo - 1][1] == free[lo][0]:
            free[lo - 1] = (free[lo - 1][0], free[lo - 1][1] + free[lo][1])
            del free[lo]

    @property
    def idle(self) -> bool:
        return self.leased == 0


class ExchangePool:
    """Caller-side pool. Not thread-safe for concurrent ``generate`` calls (neither is the
    generator); releases may come from any thread (they are queued and applied on the next
    ``allocate``)."""

    def __init__(self, directory: str | None = None):
        self.directory = directory or shm_dir()
        self.chunks: dict[int, Chunk] = {}
        self._next_id = 0
        self._released: collections.deque = collections.deque()
        # (bytes the caller still held + the call, the call) of the last WINDOW allocations
        self._recent: collections.deque = collections.deque(maxlen=WINDOW)
        self.stats = {"calls": 0, "chunks_created": 0, "chunks_dropped": 0, "bytes_created": 0,
                      "chunks_reserved": 0, "bytes_reserved": 0}

    # -- bookkeeping --------------------------------------------------------------------
    @property
    def peak_demand(self) -> int:
        """The largest (held + call) bytes of the last WINDOW calls."""
        return max((demand for demand, _ in self._recent), default=0)

    @property
    def peak_call_bytes(self) -> int:
        """The largest call of the last WINDOW calls."""
        return max((call for _, call in self._recent), default=0)

    @property
    def capacity(self) -> int:
        return sum(c.size for c in self.chunks.values())

    @property
    def leased(self) -> int:
        self._drain()
        return sum(c.leased for c in self.chunks.values())

    def _drain(self) -> None:
        while True:
            try:
                chunk_id, off, nbytes = self._released.popleft()
            except IndexError:
                return
            chunk = self.chunks.get(chunk_id)
            if chunk is not None:
                chunk.give(off, nbytes)

    def _new_chunk(self, size: int) -> Chunk:
        chunk_id = self._next_id
        self._next_id += 1
        chunk = Chunk(chunk_id, self.directory, size)
        chunk.last_busy = self.stats["calls"]
        self.chunks[chunk_id] = chunk
        self.stats["chunks_created"] += 1
        self.stats["bytes_created"] += size
        return chunk

    def reserve(self, nbytes: int) -> list[Chunk]:
        """Grow to at least ``nbytes`` before the first call (what the first calls would grow to
        inside the caller's loop), never past half the folder's free space: the new chunks, for
        the workers to map. Kept by the same rule as grown ones: a chunk the calls use stays."""
        st = os.statvfs(self.directory)
        grow = min(_round_up(nbytes - self.capacity, MIN_CHUNK), st.f_bavail * st.f_frsize // 2 // MIN_CHUNK * MIN_CHUNK)
        if nbytes <= self.capacity or grow <= 0:
            return []
        chunk = self._new_chunk(grow)
        self.stats["chunks_reserved"] += 1
        self.stats["bytes_reserved"] += chunk.size
        return [chunk]

    # -- one generate call ----------------------------------------------------------------
    def allocate(self, sizes: dict) -> tuple[dict, list[Chunk], list[int]]:
        """Lease one segment per key: ({key: (chunk_id, offset, nbytes)}, new chunks, dropped ids).

        New chunks must be mapped by the workers (``Chunk.ref``); dropped ones unmapped.
        """
        return self.allocate_runs([[(key, n)] for key, n in sizes.items()])

    def allocate_runs(self, runs: list) -> tuple[dict, list[Chunk], list[int]]:
        """``allocate`` for runs of (key, nbytes): a run's segments lie back to back in one chunk,
        in the order given (each rounded up to GRAIN bytes, the run to ALIGN; the last key holds
        the run's padding), so rows of consecutive keys form one range (one copy, not one per key)."""
        self._drain()
        self.stats["calls"] += 1
        layout = []
        for run in runs:
            parts = [[key, _round_up(n, GRAIN)] for key, n in run]
            size = sum(r for _, r in parts)
            padded = _round_up(size)
            parts[-1][1] += padded - size
            layout.append((parts, padded))
        call_bytes = sum(padded for _, padded in layout)
        self._recent.append((sum(c.leased for c in self.chunks.values()) + call_bytes, call_bytes))
        placements: dict = {}
        missing, used = [], set()

        def place(parts, chunk, off):
            for key, reserved in parts:
                placements[key] = (chunk.id, off, reserved)
                off += reserved
            used.add(chunk.id)

        # largest first: fewer holes
        for parts, padded in sorted(layout, key=lambda run: run[1], reverse=True):
            for chunk in self.chunks.values():
                off = chunk.take(padded)
                if off is not None:
                    place(parts, chunk, off)
                    break
            else:
                missing.append((parts, padded))
        missing = [run for run in missing if not self._place_split(run[0], place)]
        new = []
        if missing:
            need = sum(padded for _, padded in missing)
            # grow to what the caller keeps alive plus a call (results held while saved): no chunk per
            # call; where the memory cannot hold that, only what this call needs (as it always could)
            grow = _round_up(max(MIN_CHUNK, need, self._target() - self.capacity), MIN_CHUNK)
            least = max(MIN_CHUNK, need)
            try:
                try:
                    chunk = self._new_chunk(grow)
                except ExchangeError:
                    if grow <= least:
                        raise
                    chunk = self._new_chunk(least)
            except BaseException:
                self.release(placements)
                raise
            new.append(chunk)
            for parts, padded in missing:
                off = chunk.take(padded)
                if off is None:  # the chunk was sized for these runs
                    raise ExchangeError(f"a new {chunk.size}-byte chunk could not hold {padded} bytes")
                place(parts, chunk, off)
        calls = self.stats["calls"]
        for chunk in self.chunks.values():
            if not chunk.idle:
                chunk.last_busy = calls
        dropped = []
        keep = self._target()
        capacity = self.capacity
        for chunk in sorted(self.chunks.values(), key=lambda c: c.size, reverse=True):
            if capacity <= keep:
                break
            # only a chunk idle for the whole window: a caller that saves every N < WINDOW calls
            # keeps its room instead of making it again each time
            if chunk.idle and chunk.id not in used and calls - chunk.last_busy >= WINDOW:
                del self.chunks[chunk.id]
                chunk.close()
                capacity -= chunk.size
                dropped.append(chunk.id)
                self.stats["chunks_dropped"] += 1
        return placements, new, dropped

    def _target(self) -> int:
        """Capacity kept: the largest demand (held + call) plus one call of room (2x the largest
        call when the caller holds nothing between calls), over the last WINDOW calls."""
        return self.peak_demand + self.peak_call_bytes

    def _place_split(self, parts, place) -> bool:
        """A run with no contiguous room, placed key by key in the holes (more copies, no new
        memory); False (nothing placed) where the holes cannot hold every key."""
        taken = []
        for key, reserved in parts:
            size = _round_up(reserved)
            for chunk in self.chunks.values():
                off = chunk.take(size)
                if off is not None:
                    taken.append((key, chunk, off, size))
                    break
            else:
                for _key, chunk, off, size in taken:
                    chunk.give(off, size)
                return False
        for key, chunk, off, size in taken:
            place([(key, size)], chunk, off)
        return True

    def release(self, placements: dict) -> None:
        """Give back leases that never became result tensors (a failed call)."""
        for chunk_id, off, nbytes in placements.values():
            chunk = self.chunks.get(chunk_id)
            if chunk is not None:
                chunk.give(off, nbytes)

    def lease_view(self, placement: tuple, nbytes: int) -> memoryview:
        """The leased bytes as a memoryview; the segment returns when it (and every tensor
        made from it) is gone."""
        chunk_id, off, reserved = placement
        view = self.chunks[chunk_id].view[off : off + nbytes]
        weakref.finalize(view, self._released.append, (chunk_id, off, reserved))
        return view

    def locate(self, ptr: int, nbytes: int) -> tuple[tuple, int] | None:
        """(the chunk's (fd, dev, ino, size), byte offset) of ``nbytes`` at address ``ptr`` where
        they lie inside one chunk of this pool, else None (a saver maps that chunk to read them)."""
        for chunk in list(self.chunks.values()):
            if chunk.fd is not None and chunk.base <= ptr and ptr + nbytes <= chunk.base + chunk.size:
                return (chunk.fd, chunk.dev, chunk.ino, chunk.size), ptr - chunk.base
        return None

    def forget(self, chunks: list[Chunk]) -> None:
        """Drop idle chunks from the pool (the workers drop them at the next call)."""
        for chunk in chunks:
            if chunk.idle and self.chunks.pop(chunk.id, None) is not None:
                chunk.close()
