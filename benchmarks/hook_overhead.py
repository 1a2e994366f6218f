"""Per-layer cost of the shim's capture: a decoder layer called directly vs through the shim.

The shim does not call decoder layers itself (speculators' loop did, with one architecture's
conventions); it keeps the model's own forward and reads chosen layers' outputs through a
forward hook (``extraction.capture.CaptureState.on_layer_output`` with the layer's adapter from
``speculators_compat.layers``). What a layer call costs extra is therefore:
1. PyTorch's hook dispatch (``Module.__call__`` takes its slow path when a module has hooks);
2. the shim's hook: adapter lookup of the residual stream (``hidden + residual``: a real tensor
   op, which speculators' own loop does as well), row placement, the copy to the exchange buffer.
Uncaptured layers carry no hook and cost nothing.

Measured on a layer object of vLLM's fused-residual shape (class ``LlamaDecoderLayer``, same
``forward(positions, hidden_states, residual)`` signature, returning ``(hidden, residual)``), on
CPU tensors small enough that the call overhead dominates, median over repetitions of N calls:

    python benchmarks/hook_overhead.py --out benchmarks/results/hook_overhead.json

Reported: ns per call for (a) direct call, no hook; (b) with a no-op forward hook (PyTorch's
dispatch alone); (c) with the shim's hook, capture inactive for this rank (``capture=False``: no
hook registered — same as (a), so not measured); (d) with the shim's hook capturing one step
into a buffer (adapter + placement + copy); and (e) the adapter function alone (``residual_stream``
+ ``check_output`` skipped after the first call) against computing ``hidden + residual`` inline.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--tokens", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--device", default="cpu", help="cpu, or cuda: the GPU path (side-stream copy into page-locked memory)")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch

    from speculators_compat.layers import adapter_for
    from speculators_compat.extraction.capture import CaptureState

    torch.set_num_threads(1)

    class LlamaDecoderLayer(torch.nn.Module):  # vLLM's signature and return convention
        def forward(self, positions, hidden_states, residual):
            return hidden_states, residual

    layer = LlamaDecoderLayer()
    adapter = adapter_for(type(layer))
    dev = torch.device(args.device)
    positions = torch.arange(args.tokens, device=dev)
    hidden = torch.randn(args.tokens, args.hidden, device=dev)
    residual = torch.randn(args.tokens, args.hidden, device=dev)

    class _Worker:  # what CaptureState reads from vLLM's worker in this path
        model_runner = None

    state = CaptureState(_Worker(), [0])
    state.capture = True
    state.runner_kind = "v1"
    # one exchange chunk holding sequence "r"'s block, as CaptureState.begin sets it up
    row_bytes = args.hidden * hidden.element_size()
    chunk = torch.empty(args.tokens * row_bytes, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    state.chunks = {0: (chunk, None, dev.type == "cuda")}
    state.places, state.lengths = {"r": [(0, 0)]}, {"r": args.tokens}
    state.layout = (hidden.dtype, args.hidden, row_bytes)
    state.written = {"r": [0]}
    state.pinned = dev.type == "cuda"
    state.active = True
    buf = chunk.view(hidden.dtype).view(args.tokens, args.hidden)
    state.batch_order = lambda: ["r"]
    state.set_step({"r": (args.tokens, 0)})

    def shim_hook(module, inputs, output):
        state.on_layer_output(0, adapter, module, output)

    def noop_hook(module, inputs, output):
        return None

    def once(fn) -> float:
        t = time.perf_counter_ns()
        for _ in range(args.calls):
            fn()
        return (time.perf_counter_ns() - t) / args.calls

    def call():
        layer(positions, hidden, residual)

    out = (hidden, residual)
    variants = {
        "a_direct_ns": (None, call),
        "b_noop_hook_ns": (noop_hook, call),
        "d_shim_hook_capturing_ns": (shim_hook, call),
        "e_adapter_residual_stream_ns": (None, lambda: adapter.residual_stream(out)),
        "e_inline_add_ns": (None, lambda: hidden + residual),
    }
    h = layer.register_forward_hook(shim_hook)
    call()  # the first captured call checks the output's shape once
    h.remove()
    samples = {k: [] for k in variants}
    # interleaved: every repetition times every variant, so machine load hits them alike
    for _ in range(args.reps):
        for name, (hook, fn) in variants.items():
            h = layer.register_forward_hook(hook) if hook else None
            samples[name].append(once(fn))
            if h:
                h.remove()
            if dev.type == "cuda":
                torch.cuda.synchronize()  # launch cost only: drain the queued kernels between variants
    results = {k: statistics.median(v) for k, v in samples.items()}
    if dev.type == "cuda":
        torch.cuda.synchronize()
    if not torch.equal(buf, (hidden + residual).cpu()):
        raise SystemExit("the shim's hook did not capture hidden + residual")
    results["added_by_dispatch_ns"] = results["b_noop_hook_ns"] - results["a_direct_ns"]
    results["added_by_shim_hook_ns"] = results["d_shim_hook_capturing_ns"] - results["a_direct_ns"]
    results["added_by_adapter_ns"] = results["e_adapter_residual_stream_ns"] - results["e_inline_add_ns"]
    results["spread_ns"] = {k: [round(min(v), 1), round(max(v), 1)] for k, v in samples.items()}
    out = {
        "command": " ".join(sys.argv),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "machine": platform.machine(),
        "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
        "tokens": args.tokens,
        "hidden": args.hidden,
        "calls_per_rep": args.calls,
        "reps": args.reps,
        "results_ns_per_call": {k: (round(v, 1) if isinstance(v, float) else v) for k, v in results.items()},
        "load_average": list(os.getloadavg()),
    }
    text = json.dumps(out, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
