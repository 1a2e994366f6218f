"""Capture in vLLM's worker: right for every architecture, on V1 and V2 model runners.

speculators replaces the base model's forward with a loop hard-coding one calling convention
(renamed embedding methods, DeepSeek's ``llama_4_scaling``, Gemma's embedding scale, Qwen3-VL's
deepstack: silently wrong). ``worker-capture-hooks`` keeps the model's forward and reads the
chosen layers with forward hooks (``layers``); ``worker-v2-batch-order`` reads Model Runner V2's
batch order; ``worker-capture-rpc`` serves the driver (``extraction.protocol``).
Versions: compat_matrix.yaml. Details: docs/MODULES.md.
"""

from __future__ import annotations

import logging
import os

from ..extraction import protocol, selfcheck
from ..extraction.capture import CaptureState
from ..extraction.protocol import RPC_NAME
from ..layers import adapter_for, find_decoder_stack
from ..registry import MISSING, Call, Patch, wrapper_patch
from ._signatures import WORKER, import_attr, parameters

__all__ = ["RPC_NAME", "STATE_ATTR", "compat_rpc", "setup_hidden_states_capture"]

logger = logging.getLogger("speculators_compat")

STATE_ATTR = "_speculators_compat_capture"


V2_RUNNER = "vllm.v1.worker.gpu.model_runner"
ORDER_ATTR = "_speculators_compat_order"  # on a V2 runner instance: the CaptureState to tell


def _prepare_inputs_tap(wrapped, instance, args, kwargs):
    """GPUModelRunner.prepare_inputs (V2), as vLLM wrote it, then: tell this runner's capture
    (if any) the row order of the batch it prepared."""
    batch = wrapped(*args, **kwargs)
    state = getattr(instance, ORDER_ATTR, None)
    if state is not None:
        req_ids = getattr(batch, "req_ids", None)
        if req_ids is None:
            raise RuntimeError(
                f"V2 model runner: expected prepare_inputs to return a batch with req_ids; found {type(batch).__name__}"
            )
        state.last_v2_req_ids = list(req_ids)
    return batch


def _probe_prepare_inputs(current):
    params = parameters(current)
    if params is None or "scheduler_output" not in params:
        return f"expected GPUModelRunner.prepare_inputs(self, scheduler_output, ...) (V2); found {current!r}"
    try:
        from vllm.v1.worker.gpu.input_batch import InputBatch
    except ImportError as exc:
        return f"expected vllm.v1.worker.gpu.input_batch.InputBatch (V2 batch); import failed: {exc}"
    fields = getattr(InputBatch, "__dataclass_fields__", None) or getattr(InputBatch, "__annotations__", {})
    if "req_ids" not in fields:
        return f"expected the V2 InputBatch to carry req_ids (the batch's row order); found fields {sorted(fields)[:12]}"
    return None


def _attach_v2_order(state, runner) -> None:
    """Route this V2 runner's batch order to ``state`` through the registry's patch."""
    method = getattr(type(runner), "prepare_inputs", None)
    wrapper = getattr(method, "_self_wrapper", None)
    if wrapper is not _prepare_inputs_tap:
        import speculators_compat

        status = next((r for r in speculators_compat.report() if r["id"] == "worker-v2-batch-order"), {})
        raise RuntimeError(
            f"capture: the V2 model runner {type(runner).__qualname__}.prepare_inputs is not wrapped by the "
            f"worker-v2-batch-order patch (status {status.get('status')!r}: {status.get('reason') or 'no reason recorded'}); rows cannot be "
            "placed in batch order"
        )
    setattr(runner, ORDER_ATTR, state)


def setup_hidden_states_capture(self, layer_ids):
    """Replacement of HiddenStatesWorkerExtension._setup_hidden_states_capture.

    Everything is validated before the hooks of an earlier set-up are touched: a bad call
    leaves the earlier capture as it was."""
    from vllm.distributed import get_tp_group

    from ..extraction.inputs import check_layer_ids

    check_layer_ids(layer_ids)  # kinds only: a repeated id is captured once
    runner = self.model_runner
    if hasattr(runner, "input_batch"):
        runner_kind = "v1"
    elif callable(getattr(runner, "prepare_inputs", None)):
        runner_kind = "v2"
    else:
        raise RuntimeError(
            f"capture: unknown model runner {type(runner).__module__}.{type(runner).__qualname__}: "
            "expected input_batch (V1) or prepare_inputs (V2)"
        )
    base, layers = find_decoder_stack(runner.model)
    n = len(layers)
    for lid in layer_ids:
        if not 0 <= lid < n:
            raise ValueError(f"layer id {lid} out of range: {type(base).__name__} has {n} decoder layers")
    start = getattr(base, "start_layer", 0)
    end = getattr(base, "end_layer", n)
    state = CaptureState(self, layer_ids)
    state.runner_kind = runner_kind
    state.capture = get_tp_group().rank_in_group == 0
    adapters = {}
    for lid in state.layer_ids:
        if start <= lid < end:  # else another pipeline stage holds it
            layer = layers[lid]
            adapters.setdefault(type(layer), adapter_for(type(layer)))
    # validated: now replace the earlier set-up
    old = getattr(self, STATE_ATTR, None)
    if old is not None:
        old.abort()
        for h in old.handles:
            h.remove()
        state.chunks = old.chunks  # mapped (and page-locked) exchange memory stays with the worker
    self._layer_ids = frozenset(layer_ids)
    self._captured_states = None
    self._request_metadata = []
    self._current_request_metadata = None
    if runner_kind == "v2":
        _attach_v2_order(state, runner)
    if state.capture:
        for lid in state.layer_ids:
            if start <= lid < end:
                layer = layers[lid]
                state.handles.append(layer.register_forward_hook(_make_hook(state, lid, adapters[type(layer)])))
        _hook_self_check(state, base, layers, start, end)
    setattr(self, STATE_ATTR, state)
    logger.info(
        "speculators_compat: capture on layers %s of %s (%s runner, adapters %s, rank captures: %s)",
        state.layer_ids,
        type(base).__name__,
        state.runner_kind,
        sorted({a.name for a in adapters.values()}),
        state.capture,
    )


def _hook_self_check(state, base, layers, start, end) -> None:
    """What the self-check reads of the engine's own computation (``extraction.selfcheck``): the
    token ids the embedding receives, the positions the stage's first layer receives, and the
    final norm's output where this stage captures the last layer."""
    embedding = selfcheck.embedding_of(base) if start == 0 else None
    if embedding is not None:
        hook = embedding.register_forward_pre_hook(lambda m, args: state.on_input_ids(args[0]) if args else None)
        state.handles.append(hook)
    else:
        state.why_not["tokens"] = "no embedding on this stage"
    first = layers[start] if start < end else None
    at = selfcheck.positions_index(type(first)) if first is not None else None
    if first is not None and at is not None:

        def positions_hook(module, args, kwargs):
            state.on_positions(kwargs["positions"] if "positions" in kwargs else args[at] if len(args) > at else None)

        state.handles.append(first.register_forward_pre_hook(positions_hook, with_kwargs=True))
    else:
        state.why_not["positions"] = "the first layer's forward takes no positions"
    last = len(layers) - 1
    if last not in state.layer_ids:
        state.why_not["final"] = f"layer {last} not captured"
        return
    norm, why = selfcheck.final_norm_of(base, len(layers), end)
    if norm is None:
        state.why_not["final"] = str(why)
        return
    state.final_norm, state.final_slot = norm, state.slot[last]
    state.handles.append(norm.register_forward_hook(lambda m, args, output: state.on_final_norm(output)))


def _make_hook(state, layer_id, adapter):
    def hook(module, inputs, output):
        state.on_layer_output(layer_id, adapter, module, output)

    return hook


def compat_rpc(self, seq, op, *args):
    """The shim's one RPC entry (``extraction.protocol``): every reply echoes ``seq``; errors
    come back as values with their worker traceback."""
    try:
        if op == protocol.FENCE:
            return protocol.ok(seq)
        state = getattr(self, STATE_ATTR, None)
        if state is None:
            raise RuntimeError("capture not set up: call _setup_hidden_states_capture first")
        if op == protocol.BEGIN:
            return protocol.ok(seq, state.begin(*args))
        if op == protocol.STEP:
            state.set_step(*args)
            return protocol.ok(seq)
        if op == protocol.FINISH:
            return protocol.ok(seq, state.finish())
        if op == protocol.ABORT:
            state.abort()
            return protocol.ok(seq)
        if op == protocol.DESCRIBE:
            import speculators_compat

            return protocol.ok(
                seq,
                {
                    "runner": state.runner_kind,
                    "runner_class": type(self.model_runner).__qualname__,
                    "pid": os.getpid(),
                    "layers": state.layer_ids,
                    "captures": state.capture,
                    "self_check_not_covered": state.why_not,
                    # the worker's own view of the engine config (the async-scheduling patch)
                    "async_scheduling": getattr(
                        getattr(getattr(self, "vllm_config", None), "scheduler_config", None), "async_scheduling", None
                    ),
                    "patches": speculators_compat.report(),
                },
            )
        raise ValueError(f"unknown capture operation {op!r}")
    except BaseException as exc:  # noqa: BLE001 - reported to the driver with its traceback
        return protocol.failure(seq, exc)


def _replace_setup(wrapped, instance, args, kwargs):
    return setup_hidden_states_capture(instance, *args, **kwargs)


# Bound by check, not required by the probes: the driver's path runs without them. The hooks call
# speculators' own store on its legacy path (speculators' own generate) and a multimodal wrapper's
# language model where it has one (layers.find_decoder_stack falls back); the RPC's self-check
# calls the model's final norm (a failure there reads "not covered"): RMSNorm's native form
# stands for it (other norm classes, and the CUDA form its dispatch may pick, are not bound).
HOOKS_CALLS = (
    Call(WORKER, "HiddenStatesWorkerExtension._store_captured_states", args=("aux_hidden_states",)),
    Call("vllm.model_executor.models.interfaces", "SupportsMultiModal.get_language_model", optional=True),
)
RPC_CALLS = (Call("vllm.model_executor.layers.layernorm", "RMSNorm.forward_native", args=("x",)),)


def _probe_setup(current):
    params = parameters(current)
    if params is None or "layer_ids" not in params:
        return f"expected _setup_hidden_states_capture(self, layer_ids); found {current!r}"
    try:
        from vllm.distributed import get_tp_group  # noqa: F401
        from vllm.distributed.parallel_state import GroupCoordinator
    except ImportError as exc:
        return f"expected vllm.distributed.get_tp_group and GroupCoordinator; import failed: {exc}"
    from .engine_options import _code_names

    def has(cls, name):  # a class attribute or property, or one its __init__ sets
        return hasattr(cls, name) or name in _code_names(cls.__init__)

    if not has(GroupCoordinator, "rank_in_group"):
        return "expected GroupCoordinator.rank_in_group (the capturing rank is 0); not found"
    try:  # V1 model runners: the batch's row order is input_batch.req_ids
        v1_batch = import_attr("vllm.v1.worker.gpu_input_batch", "InputBatch")
    except Exception:  # noqa: BLE001 - no V1 runner here: the V2 order (worker-v2-batch-order)
        v1_batch = None
    if v1_batch is not None and not has(v1_batch, "req_ids"):
        return "expected the V1 InputBatch to have req_ids (the batch's row order); not found"
    return None


def _build_rpc(current):
    return compat_rpc


def _probe_rpc(current):
    if current is not MISSING:
        return f"expected HiddenStatesWorkerExtension without {RPC_NAME}; found {current!r}"
    return None


PATCHES = [
    wrapper_patch(
        "worker-v2-batch-order",
        "layer-calling",
        V2_RUNNER,
        "GPUModelRunner.prepare_inputs",
        _prepare_inputs_tap,
        _probe_prepare_inputs,
    ),
    wrapper_patch(
        "worker-capture-hooks",
        "layer-calling",
        WORKER,
        "HiddenStatesWorkerExtension._setup_hidden_states_capture",
        _replace_setup,
        _probe_setup,
        calls=HOOKS_CALLS,
        # on V2 model runners the capture places rows in the batch order this patch reads
        requires=("worker-v2-batch-order",),
    ),
    Patch(
        id="worker-capture-rpc",
        family="execution",
        hook_module=WORKER,
        attribute=f"HiddenStatesWorkerExtension.{RPC_NAME}",
        build=_build_rpc,
        probe=_probe_rpc,
        calls=RPC_CALLS,
        requires=("worker-capture-hooks",),  # the RPC serves the hooks' capture
    ),
]

