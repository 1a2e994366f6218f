"""Capture in vLLM's worker: right for every architecture, on V1 and V2 model runners.

What vLLM changed, and how the patches answer (versions: compat_matrix.yaml):
- speculators' ``_setup_hidden_states_capture`` replaces the base model's ``forward`` with a loop
  hard-coding one calling convention: the embedding method was renamed (0.11.1/0.12:
  ``get_input_embeddings`` → ``embed_input_ids``), DeepseekV2/V3/Kimi layers take
  ``llama_4_scaling`` from 0.12 (computed by the model's own forward: omitting it is silently
  wrong), Gemma scales embeddings in its own method, Qwen3-VL adds deepstack embeddings in its
  own forward; 0.3.0 also refuses models without the ``SupportsEagle3`` marker and takes
  ``model.model`` of multimodal wrappers. The replacement keeps the model's own forward
  untouched and reads the chosen layers' outputs with forward hooks, through the
  per-architecture adapters of ``speculators_compat.layers`` (resolved once at setup).
- Model Runner V2 (default for some architectures from 0.22, all from 0.29) has no
  ``model_runner.input_batch`` and orders each step's requests by scheduled tokens. Capture
  places each step's rows by the runner's own row order: V1 ``input_batch.req_ids``; V2 the
  ``req_ids`` of the batch its ``prepare_inputs`` returns (read through an instance wrapper on
  this worker's runner only). Anything else is a clear error at setup.
- Data path: instead of pickling every captured tensor through one RPC (measured: 1.7–2.0 s of
  a 2.1 s batch on an H200), the driver leases one shared-memory block [layers, tokens, hidden]
  per sequence from its exchange pool (``speculators_compat.exchange``); the worker maps each
  pool chunk once (page-locked on GPUs) and copies each step's rows straight to their final
  place (input order, one contiguous block per sequence and layer), from a side CUDA stream on
  GPUs. The RPCs carry only small metadata.
Speculators' own ``_reset_capture``/``_get_captured_states`` keep working (legacy path) when no
shared buffer is active.
"""

from __future__ import annotations

import logging
import os
import traceback

from ..layers import adapter_for, find_decoder_stack
from ..registry import MISSING, Patch, wrapper_patch
from ._signatures import WORKER, parameters

logger = logging.getLogger("speculators_compat")

STATE_ATTR = "_speculators_compat_capture"
RPC_NAME = "_speculators_compat_rpc"


class CaptureState:
    """Per-worker capture state: hooks, the active buffer, and this step's row placement."""

    def __init__(self, worker, layer_ids):
        self.worker = worker
        self.layer_ids = sorted(set(layer_ids))
        self.slot = {lid: k for k, lid in enumerate(self.layer_ids)}
        self.handles = []
        self.capture = False  # TP rank 0 only
        self.runner_kind = None
        self.last_v2_req_ids = None
        self.buffers = None  # req_id -> tensor [layers, tokens, hidden] in shared memory
        self.chunks = {}  # exchange chunk id -> (uint8 tensor mapping it, page-locked?); kept across calls
        self.step = None  # req_id -> (num_tokens, num_computed_before)
        self.spans = None  # [(src_row, dst_row, n)] for the current step
        self.expected_rows = 0
        self.copy_stream = None
        self.pinned = False
        self.legacy_step = {}
        self.checked = set()

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

    def compute_spans(self) -> list[tuple[int, int, int]]:
        order = self.batch_order()
        spans, src = [], 0
        for req_id in order:
            if req_id not in self.step:
                raise RuntimeError(
                    f"capture: the runner's batch holds request {req_id!r} that the driver did not schedule "
                    f"this step (scheduled: {sorted(self.step)})"
                )
            n, done = self.step[req_id]
            spans.append((src, self.buffers[req_id], done, n))
            src += n
        if src != self.expected_rows or len(order) != len(self.step):
            raise RuntimeError(
                f"capture: the runner's batch ({len(order)} requests, {src} rows) differs from the "
                f"scheduled step ({len(self.step)} requests, {self.expected_rows} rows)"
            )
        return spans

    # -- the hook -----------------------------------------------------------------------
    def on_layer_output(self, layer_id, adapter, module, output):
        if layer_id not in self.checked:
            adapter.check_output(type(module), output)
            self.checked.add(layer_id)
        stream = adapter.residual_stream(output)
        if self.buffers is not None:
            if self.spans is None:
                self.spans = self.compute_spans()
            self._copy_rows(self.slot[layer_id], stream)
        else:
            self.legacy_step[layer_id] = stream.clone()
            if len(self.legacy_step) == len(self.layer_ids):
                states = [self.legacy_step[lid] for lid in self.layer_ids]
                self.legacy_step = {}
                self.worker._store_captured_states(states)

    def _copy_rows(self, slot, stream):
        import torch

        if stream.device.type == "cuda":
            if self.copy_stream is None:
                self.copy_stream = torch.cuda.Stream(device=stream.device)
            self.copy_stream.wait_stream(torch.cuda.current_stream(stream.device))
            stream.record_stream(self.copy_stream)
            with torch.cuda.stream(self.copy_stream):
                for src, buf, d, n in self.spans:
                    buf[slot, d : d + n].copy_(stream[src : src + n], non_blocking=self.pinned)
        else:
            for src, buf, d, n in self.spans:
                buf[slot, d : d + n].copy_(stream[src : src + n])

    # -- RPC operations -------------------------------------------------------------------
    def begin(self, new_chunks, live_chunks, placements, layers, hidden, dtype_name, pin):
        """Map the driver's new exchange chunks {id: (path, bytes)}, drop those no longer live,
        and place each sequence: {req_id: (chunk id, byte offset, tokens)} -> [layers, tokens, hidden]."""
        import torch

        if self.copy_stream is not None:
            self.copy_stream.synchronize()  # copies of a call that failed may still be in flight
        self.end()
        # forwards outside a driver call (vLLM's warm-up dummy run) went to speculators' own
        # store: drop them, as speculators' _reset_capture does, so they hold no device memory
        self.worker._captured_states = None
        self.legacy_step = {}
        if not self.capture:
            return {"rank_captures": False}
        live = set(live_chunks)
        for chunk_id in [c for c in self.chunks if c not in live]:
            tensor, pinned = self.chunks.pop(chunk_id)
            if pinned:
                _host_unregister(tensor)
        for chunk_id, (path, size) in new_chunks.items():
            tensor = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            pinned = bool(pin) and torch.cuda.is_available() and _host_register(tensor)
            self.chunks[chunk_id] = (tensor, pinned)
        dtype = getattr(torch, dtype_name)
        row_bytes = layers * hidden * torch.empty((), dtype=dtype).element_size()
        buffers, pinned = {}, True
        for req_id, (chunk_id, offset, n) in placements.items():
            tensor, chunk_pinned = self.chunks[chunk_id]
            pinned = pinned and chunk_pinned
            buffers[req_id] = tensor[offset : offset + n * row_bytes].view(dtype).view(layers, n, hidden)
        self.buffers = buffers
        self.pinned = pinned
        return {"rank_captures": True, "pinned": self.pinned, "chunks": len(self.chunks)}

    def set_step(self, step):
        self.step = step
        self.spans = None
        self.expected_rows = sum(n for n, _ in step.values())

    def finish(self):
        import torch

        if self.copy_stream is not None:
            self.copy_stream.synchronize()
        elif torch.cuda.is_available():
            torch.cuda.synchronize()
        self.end()
        return True

    def end(self):
        self.buffers = None
        self.step = None
        self.spans = None
        self.pinned = False


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


def _install_v2_order_tap(state, runner):
    """Wrap this runner instance's prepare_inputs to remember the step's row order."""
    original = runner.prepare_inputs

    def prepare_inputs(*args, **kwargs):
        batch = original(*args, **kwargs)
        req_ids = getattr(batch, "req_ids", None)
        if req_ids is None:
            raise RuntimeError(
                f"V2 model runner: expected prepare_inputs to return a batch with req_ids; found {type(batch).__name__}"
            )
        state.last_v2_req_ids = list(req_ids)
        return batch

    runner.prepare_inputs = prepare_inputs


def setup_hidden_states_capture(self, layer_ids):
    """Replacement of HiddenStatesWorkerExtension._setup_hidden_states_capture."""
    from vllm.distributed import get_tp_group

    self._layer_ids = frozenset(layer_ids)
    self._captured_states = None
    self._request_metadata = []
    self._current_request_metadata = None
    old = getattr(self, STATE_ATTR, None)
    state = CaptureState(self, layer_ids)
    if old is not None:
        for h in old.handles:
            h.remove()
        state.chunks = old.chunks  # mapped (and page-locked) exchange memory stays with the worker
    runner = self.model_runner
    if hasattr(runner, "input_batch"):
        state.runner_kind = "v1"
    elif callable(getattr(runner, "prepare_inputs", None)):
        state.runner_kind = "v2"
        _install_v2_order_tap(state, runner)
    else:
        raise RuntimeError(
            f"capture: unknown model runner {type(runner).__module__}.{type(runner).__qualname__}: "
            "expected input_batch (V1) or prepare_inputs (V2)"
        )
    base, layers = find_decoder_stack(runner.model)
    n = len(layers)
    state.capture = get_tp_group().rank_in_group == 0
    for lid in state.layer_ids:
        if not 0 <= lid < n:
            raise ValueError(f"layer id {lid} out of range: {type(base).__name__} has {n} decoder layers")
    start = getattr(base, "start_layer", 0)
    end = getattr(base, "end_layer", n)
    adapters = {}
    for lid in state.layer_ids:
        if not start <= lid < end:
            continue  # another pipeline stage holds it
        layer = layers[lid]
        adapter = adapters.setdefault(type(layer), adapter_for(type(layer)))
        if state.capture:
            hook = _make_hook(state, lid, adapter)
            state.handles.append(layer.register_forward_hook(hook))
    setattr(self, STATE_ATTR, state)
    logger.info(
        "speculators_compat: capture on layers %s of %s (%s runner, adapters %s, rank captures: %s)",
        state.layer_ids,
        type(base).__name__,
        state.runner_kind,
        sorted({a.name for a in adapters.values()}),
        state.capture,
    )


def _make_hook(state, layer_id, adapter):
    def hook(module, inputs, output):
        state.on_layer_output(layer_id, adapter, module, output)

    return hook


def compat_rpc(self, op, *args):
    """One RPC entry for the shim's driver: begin / step / finish / describe.

    Errors are returned as values with their worker traceback so the driver can raise them
    with type, message and origin (a worker's exception otherwise reaches the caller as a
    generic, sometimes empty, message).
    """
    try:
        state = getattr(self, STATE_ATTR, None)
        if state is None:
            raise RuntimeError("capture not set up: call _setup_hidden_states_capture first")
        if op == "begin":
            return {"ok": True, "value": state.begin(*args)}
        if op == "step":
            state.set_step(*args)
            return {"ok": True, "value": None}
        if op == "finish":
            return {"ok": True, "value": state.finish()}
        if op == "describe":
            import speculators_compat

            return {
                "ok": True,
                "value": {
                    "runner": state.runner_kind,
                    "runner_class": type(self.model_runner).__qualname__,
                    "pid": os.getpid(),
                    "layers": state.layer_ids,
                    "captures": state.capture,
                    # the worker's own view of the engine config (the async-scheduling patch)
                    "async_scheduling": getattr(
                        getattr(getattr(self, "vllm_config", None), "scheduler_config", None), "async_scheduling", None
                    ),
                    "patches": speculators_compat.report(),
                },
            }
        raise ValueError(f"unknown capture operation {op!r}")
    except BaseException as exc:  # noqa: BLE001 - reported to the driver with its traceback
        return {
            "ok": False,
            "type": type(exc).__name__,
            "message": str(exc),
            "traceback": traceback.format_exc(),
            "pid": os.getpid(),
        }


def _replace_setup(wrapped, instance, args, kwargs):
    return setup_hidden_states_capture(instance, *args, **kwargs)


def _probe_setup(current):
    params = parameters(current)
    if params is None or "layer_ids" not in params:
        return f"expected _setup_hidden_states_capture(self, layer_ids); found {current!r}"
    try:
        from vllm.distributed import get_tp_group  # noqa: F401
    except ImportError as exc:
        return f"expected vllm.distributed.get_tp_group; import failed: {exc}"
    return None


def _build_rpc(current):
    return compat_rpc


def _probe_rpc(current):
    if current is not MISSING:
        return f"expected HiddenStatesWorkerExtension without {RPC_NAME}; found {current!r}"
    return None


PATCHES = [
    wrapper_patch(
        "worker-capture-hooks",
        "layer-calling",
        WORKER,
        "HiddenStatesWorkerExtension._setup_hidden_states_capture",
        _replace_setup,
        _probe_setup,
    ),
    Patch(
        id="worker-capture-rpc",
        family="execution",
        hook_module=WORKER,
        attribute=f"HiddenStatesWorkerExtension.{RPC_NAME}",
        build=_build_rpc,
        probe=_probe_rpc,
    ),
]

