"""The worker side of an extraction: where each forward's rows go, and proof they went there.

One ``CaptureState`` per worker: ``begin`` maps the caller's exchange chunks (checked to be the
very files the caller made), ``step`` places the next forward's rows, the forward hooks copy the
chosen layers' rows (a side CUDA stream on GPUs) and count them, ``finish`` returns the rows
written in this call and the self-check's report. Details: docs/MODULES.md.
"""

from __future__ import annotations

import mmap
import os
import stat

from .protocol import Begin
from .selfcheck import RowCheck


class ChunkMismatch(RuntimeError):
    """An exchange chunk the worker was told to map is not the file the caller created."""


def map_chunk(caller_pid: int, ref):
    """(uint8 tensor over the caller's chunk, mmap) — never creates or follows a named path."""
    import torch

    path = f"/proc/{caller_pid}/fd/{ref.fd}"
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ChunkMismatch(
            f"cannot open the caller's exchange chunk {path}: {exc.strerror} "
            "(the worker must run on the caller's host as the same user)"
        ) from None
    try:
        st = os.fstat(fd)
        found = (st.st_dev, st.st_ino, st.st_size)
        if not stat.S_ISREG(st.st_mode) or found != (ref.dev, ref.ino, ref.size):
            raise ChunkMismatch(
                f"exchange chunk {path} is not the file the caller created: expected "
                f"(dev, inode, bytes) {(ref.dev, ref.ino, ref.size)}, found {found}"
            )
        mm = mmap.mmap(fd, ref.size)
    finally:
        os.close(fd)
    return torch.frombuffer(mm, dtype=torch.uint8), mm


class CaptureState:
    """Per-worker capture state: hooks, the active buffers, this step's row placement."""

    def __init__(self, worker, layer_ids):
        self.worker = worker
        self.layer_ids = sorted(set(layer_ids))
        self.slot = {lid: k for k, lid in enumerate(self.layer_ids)}
        self.handles = []
        self.capture = False  # TP rank 0 (of each pipeline stage) only
        self.runner_kind = None
        self.last_v2_req_ids = None
        self.call = None
        self.active = False  # inside a driver call (begin .. finish/abort)
        self.written = None  # req_id -> [rows written this call, per captured layer]
        self.chunks = {}  # exchange chunk id -> (uint8 tensor, mmap, page-locked?); kept across calls
        self.step = None  # req_id -> (num_tokens, num_computed_before)
        self.spans = None  # [(src_row, req_id, dst_row, n)] for the current step
        self.copies = None  # per captured layer: the step's copies, contiguous spans merged (merge_copies)
        self.places = None  # req_id -> [(chunk id, byte offset) per captured layer]
        self.lengths = None  # req_id -> rows of its blocks
        self.layout = None  # (dtype, hidden, row bytes) of this call
        self.expected_rows = 0
        self.copy_stream = None
        self.pinned = False
        self.legacy_step = {}
        self.checked = set()
        self.row_check = RowCheck(0)  # this call's self-check samples (selfcheck)
        self.sample = None  # this step's sample, or None
        self.final_norm = None  # the model's final norm where this stage runs it and captures the last layer
        self.final_slot = None
        self.why_not: dict[str, str] = {}  # self-check kind -> why this worker cannot see it
        self.in_check = False

    # -- row placement ----------------------------------------------------------------
    def batch_order(self) -> list[str]:
        runner = self.worker.model_runner
        if self.runner_kind == "v1":
            ids = runner.input_batch.req_ids
        else:
            ids = self.last_v2_req_ids
            if ids is None:
                raise RuntimeError("V2 model runner: no batch prepared before the forward (prepare_inputs not seen)")
        return [r for r in ids if r is not None]

    def compute_spans(self) -> list[tuple]:
        order = self.batch_order()
        spans, src = [], 0
        for req_id in order:
            if req_id not in self.step:
                raise RuntimeError(
                    f"capture: the runner's batch holds request {req_id!r} that the driver did not schedule "
                    f"this step (scheduled: {sorted(self.step)})"
                )
            n, done = self.step[req_id]
            spans.append((src, req_id, done, n))
            src += n
        if src != self.expected_rows or len(order) != len(self.step):
            raise RuntimeError(
                f"capture: the runner's batch ({len(order)} requests, {src} rows) differs from the "
                f"scheduled step ({len(self.step)} requests, {self.expected_rows} rows)"
            )
        return spans

    # -- the hook -----------------------------------------------------------------------
    def in_step(self) -> bool:
        """True inside one of the driver's steps; this step's spans, copies and sample made once."""
        if not self.active or self.step is None or self.in_check:
            return False  # vLLM's warm-up or a forward outside the driver's steps: nothing placed
        if self.spans is None:
            self.spans = self.compute_spans()
            self.copies = self.merge_copies(self.spans)
            self.sample = self.row_check.pick(self.spans)
        return True

    def on_input_ids(self, ids):
        if self.in_step() and self.sample is not None and getattr(ids, "dim", lambda: 0)() == 1:
            self.sample.ids = self.sample.rows(ids)

    def on_positions(self, positions):
        if self.in_step() and self.sample is not None and self.sample.pos is None and hasattr(positions, "dim"):
            if positions.dim() == 2 and positions.shape[0] <= 4:  # M-RoPE [3, tokens]: a text token's are equal
                positions = positions[0]
            if positions.dim() == 1:
                self.sample.pos = self.sample.rows(positions)

    def on_final_norm(self, output):
        if self.in_step() and self.sample is not None:
            self.sample.final = self.sample.rows(output[0] if isinstance(output, tuple) else output)

    def on_layer_output(self, layer_id, adapter, module, output):
        if layer_id not in self.checked:
            adapter.check_output(type(module), output)
            self.checked.add(layer_id)
        stream = adapter.residual_stream(output)
        if self.active:
            if not self.in_step():
                return
            slot = self.slot[layer_id]
            if self.sample is not None:
                rows = self.sample.rows(stream)
                if rows is not None:
                    self.sample.layers[slot] = rows
            self._copy_rows(slot, stream)
        else:
            self.legacy_step[layer_id] = stream.clone()
            if len(self.legacy_step) == len(self.layer_ids):
                states = [self.legacy_step[lid] for lid in self.layer_ids]
                self.legacy_step = {}
                self.worker._store_captured_states(states)

    def merge_copies(self, spans) -> list:
        """Per captured layer, the step's copies [(destination rows, source row, rows, [(req_id,
        rows)])]: consecutive spans whose source rows and destination memory are both contiguous
        (the driver lays a layer's blocks back to back in input order) become one copy."""
        dtype, hidden, row_bytes = self.layout
        out = []
        for slot in range(len(self.layer_ids)):
            runs: list = []  # [chunk id, byte start, source row, rows, parts]
            for src, rid, d, n in spans:
                chunk_id, off = self.places[rid][slot]
                if d < 0 or d + n > self.lengths[rid]:  # never past the sequence's own block
                    raise RuntimeError(f"capture: the step places rows {d}..{d + n} of {rid!r}, which has "
                                       f"{self.lengths[rid]} rows")
                start = off + d * row_bytes
                last = runs[-1] if runs else None
                if last and last[0] == chunk_id and last[1] + last[3] * row_bytes == start and last[2] + last[3] == src:
                    last[3] += n
                    last[4].append((rid, n))
                else:
                    runs.append([chunk_id, start, src, n, [(rid, n)]])
            copies = []
            for chunk_id, start, src, rows, parts in runs:
                dst = self.chunks[chunk_id][0][start : start + rows * row_bytes].view(dtype).view(rows, hidden)
                copies.append((dst, src, rows, parts))
            out.append(copies)
        return out

    def _copy_rows(self, slot, stream):
        written = self.written
        if stream.device.type == "cuda":
            import torch

            if self.copy_stream is None:
                self.copy_stream = torch.cuda.Stream(device=stream.device)
            self.copy_stream.wait_stream(torch.cuda.current_stream(stream.device))
            stream.record_stream(self.copy_stream)
            with torch.cuda.stream(self.copy_stream):
                for dst, src, rows, parts in self.copies[slot]:
                    dst.copy_(stream[src : src + rows], non_blocking=self.pinned)
                    for rid, n in parts:
                        written[rid][slot] += n
        else:
            for dst, src, rows, parts in self.copies[slot]:
                dst.copy_(stream[src : src + rows])
                for rid, n in parts:
                    written[rid][slot] += n

    # -- RPC operations -------------------------------------------------------------------
    def begin(self, b: Begin):
        import torch

        self.wait_copies()  # copies of a call that failed may still be in flight
        self.end()
        # forwards outside a driver call (vLLM's warm-up dummy run) went to speculators' own
        # store: drop them, as speculators' _reset_capture does, so they hold no device memory
        self.worker._captured_states = None
        self.legacy_step = {}
        self.call = b.call
        if not self.capture:
            return {"rank_captures": False}
        live = set(b.live_chunks)
        for chunk_id in [c for c in self.chunks if c not in live]:
            tensor, _mm, pinned = self.chunks.pop(chunk_id)
            if pinned:
                _host_unregister(tensor)
        for chunk_id, ref in b.new_chunks.items():
            tensor, mm = map_chunk(b.caller_pid, ref)
            pinned = bool(b.pin) and torch.cuda.is_available() and _host_register(tensor)
            self.chunks[chunk_id] = (tensor, mm, pinned)
        dtype = getattr(torch, b.dtype)
        row_bytes = b.hidden * torch.empty((), dtype=dtype).element_size()
        # each block is checked to lie in its chunk; the copies' views are made per step (merge_copies)
        written, places, lengths, used = {}, {}, {}, set()
        for req_id, (blocks, n) in b.placements.items():
            if len(blocks) != b.layers:
                raise ValueError(f"begin: {req_id} has {len(blocks)} layer blocks for {b.layers} layers")
            for chunk_id, offset in blocks:
                if chunk_id not in self.chunks:
                    raise ValueError(f"begin: {req_id} is placed in exchange chunk {chunk_id}, which this worker "
                                     f"was not given (it has {sorted(self.chunks)})")
                size = self.chunks[chunk_id][0].numel()
                if offset < 0 or offset + n * row_bytes > size:
                    raise ValueError(f"begin: {req_id}'s block at byte {offset} ({n} rows of {row_bytes} bytes) "
                                     f"ends past its chunk {chunk_id} of {size} bytes")
                used.add(chunk_id)
            places[req_id] = list(blocks)
            lengths[req_id] = n
            written[req_id] = [0] * b.layers
        pinned = all(self.chunks[c][2] for c in used)
        self.active = True
        self.written, self.places, self.lengths, self.pinned = written, places, lengths, pinned
        self.layout = (dtype, b.hidden, row_bytes)
        self.row_check = RowCheck(b.check_rows)
        return {"rank_captures": True, "pinned": self.pinned, "chunks": len(self.chunks)}

    def set_step(self, step):
        self.step = step
        self.spans = None
        self.copies = None
        self.sample = None
        self.expected_rows = sum(n for n, _ in step.values())

    def wait_copies(self):
        if self.copy_stream is not None:
            self.copy_stream.synchronize()

    def finish(self):
        """Wait for this call's copies; {"written": {req_id: [rows written per layer]}, "check":
        the self-check's report} (None: this rank does not capture)."""
        import torch

        if self.copy_stream is not None:
            self.copy_stream.synchronize()
        elif torch.cuda.is_available():
            torch.cuda.synchronize()
        if not self.capture:
            self.end()
            return None
        try:
            self.in_check = True
            check = self.row_check.report(self.exchange_rows, self.slot, self.final_norm, self.final_slot, self.why_not)
        finally:
            self.in_check = False
        result = {"written": self.written, "check": check}
        self.end()
        return result

    def block(self, req_id, slot):
        """The exchange's rows of ``req_id`` for captured-layer ``slot``: a (rows, hidden) view."""
        dtype, hidden, row_bytes = self.layout
        chunk_id, offset = self.places[req_id][slot]
        n = self.lengths[req_id]
        return self.chunks[chunk_id][0][offset : offset + n * row_bytes].view(dtype).view(n, hidden)

    def exchange_rows(self, wanted):
        """The exchange's rows [(req_id, slot, row)], in order, as one (len, hidden) tensor."""
        dtype, hidden, row_bytes = self.layout
        located = []
        for req_id, slot, row in wanted:
            chunk_id, offset = self.places[req_id][slot]
            located.append((chunk_id, offset + row * row_bytes))
        chunks = {chunk_id: self.chunks[chunk_id][0] for chunk_id, _ in located}
        return gather_rows(chunks, located, row_bytes).view(dtype).view(len(wanted), hidden)

    def abort(self):
        """Drop the call after a failure: no forward may write into its (released) memory."""
        self.wait_copies()
        self.end()

    def end(self):
        self.active = False
        self.written = None
        self.places = None
        self.lengths = None
        self.step = None
        self.spans = None
        self.copies = None
        self.pinned = False
        self.sample = None
        self.row_check = RowCheck(0)


def gather_rows(chunks: dict, located: list, row_bytes: int):
    """The ``row_bytes`` bytes at each (chunk id, byte offset), in order, as a (len, row_bytes)
    uint8 tensor: per chunk one fancy index over a view of every row-long window of its bytes (a
    window per byte offset; nothing is copied but the rows), not one view per row."""
    import numpy as np
    import torch

    groups: dict = {}
    for k, (chunk_id, offset) in enumerate(located):
        members = groups.setdefault(chunk_id, ([], []))
        members[0].append(k)
        members[1].append(offset)
    out = None
    for chunk_id, (order, offsets) in groups.items():
        data = chunks[chunk_id].numpy()
        windows = np.lib.stride_tricks.as_strided(data, (data.size - row_bytes + 1, row_bytes), (1, 1),
                                                  writeable=False)
        rows = windows[np.asarray(offsets, dtype=np.intp)]
        if len(groups) == 1:
            return torch.from_numpy(rows)
        if out is None:
            out = np.empty((len(located), row_bytes), dtype=np.uint8)
        out[np.asarray(order, dtype=np.intp)] = rows
    return torch.from_numpy(out if out is not None else np.empty((0, row_bytes), dtype=np.uint8))


def _host_register(tensor) -> bool:
    import torch

    if tensor.nbytes == 0:
        return True
    try:
        rc = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.nbytes, 0)
    except Exception:  # noqa: BLE001 - unpinned copies still work, only slower
        return False
    rc = rc[0] if isinstance(rc, tuple) else rc
    return int(rc) == 0


def _host_unregister(tensor) -> None:
    import torch

    if tensor.nbytes == 0:
        return
    try:
        torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
    except Exception:  # noqa: BLE001
        pass
