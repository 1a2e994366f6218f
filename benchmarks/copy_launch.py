"""What one captured (request span, layer) costs the host: the capture hook's copy pattern alone.

``extraction/capture.py``'s ``_copy_rows`` issues, for every captured layer of every step, one
``copy_`` per request span: ``buffers[rid][slot][d:d+n].copy_(stream[src:src+n], non_blocking=True)``
into host-registered (``cudaHostRegister``) memory on a side stream. The hook runs on the thread that launches
the model's kernels, so host time spent there delays the next layer's launches when the GPU is
waiting on the host. This measures, on the GPU, that loop's host time per span (launch only,
not the transfer) against one copy of the same rows per layer (the coalesced alternative), in
alternating repetitions after a warm-up, and the transfer time of the step's rows.

    python benchmarks/copy_launch.py --hidden 4096 --spans 16 64 --rows-per-span 512 128 --reps 21 --out r.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def _measure(spans: int, rows: int, hidden: int, reps: int):
    import torch

    dev = torch.device("cuda")
    total = spans * rows
    stream = torch.randn(total, hidden, device=dev, dtype=torch.bfloat16)
    # one host buffer per request, [layers=1, rows, hidden] as the exchange pool lays them out,
    # page-locked as the capture does it (cudaHostRegister on plain host memory, not torch's
    # caching pinned allocator)
    from speculators_compat.extraction.capture import _host_register, _host_unregister

    host = torch.empty(spans, 1, rows, hidden, dtype=torch.bfloat16)
    if not _host_register(host):
        raise RuntimeError("cudaHostRegister failed: the capture would copy unpinned here")
    buffers = {f"r{i}": host[i] for i in range(spans)}
    flat = host.view(total, hidden)
    side = torch.cuda.Stream(device=dev)
    span_list = [(i * rows, f"r{i}", 0, rows) for i in range(spans)]
    written = {rid: [0] for rid in buffers}

    def per_span():
        side.wait_stream(torch.cuda.current_stream(dev))
        stream.record_stream(side)
        with torch.cuda.stream(side):
            for src, rid, d, n in span_list:
                buffers[rid][0][d : d + n].copy_(stream[src : src + n], non_blocking=True)
                written[rid][0] += n

    def coalesced():
        side.wait_stream(torch.cuda.current_stream(dev))
        stream.record_stream(side)
        with torch.cuda.stream(side):
            flat.copy_(stream, non_blocking=True)

    sides = {"per_span": per_span, "coalesced": coalesced}
    for fn in sides.values():  # warm-up, not timed
        fn()
        side.synchronize()
    host_s = {k: [] for k in sides}
    device_s = {k: [] for k in sides}
    for r in range(reps):
        names = list(sides)[r % 2 :] + list(sides)[: r % 2]
        for name in names:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            sides[name]()
            t1 = time.perf_counter()
            side.synchronize()
            t2 = time.perf_counter()
            host_s[name].append(t1 - t0)
            device_s[name].append(t2 - t0)
    ok = torch.equal(flat.view(total, hidden), stream.cpu())
    _host_unregister(host)
    med = {k: statistics.median(v) for k, v in host_s.items()}
    return {
        "spans": spans,
        "rows_per_span": rows,
        "bytes": total * hidden * 2,
        "host_launch_median_s": med,
        "host_launch_per_span_us": med["per_span"] / spans * 1e6,
        # what one more span costs: the loop minus the one-copy call's fixed cost (stream
        # wait, record_stream, context switch), over the spans beyond one
        "host_launch_marginal_per_span_us": (med["per_span"] - med["coalesced"]) / max(spans - 1, 1) * 1e6,
        "until_copied_median_s": {k: statistics.median(v) for k, v in device_s.items()},
        "host_launch_s": host_s,
        "copied_rows_equal": ok,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--spans", type=int, nargs="+", default=[16, 64])
    p.add_argument("--rows-per-span", type=int, nargs="+", default=[512, 128])
    p.add_argument("--reps", type=int, default=21)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if len(args.spans) != len(args.rows_per_span):
        p.error("--spans and --rows-per-span pair up: give as many of each")
    import torch

    if not torch.cuda.is_available():
        print("copy_launch: needs a CUDA device (the capture's copy pattern is a device-to-host copy)", file=sys.stderr)
        return 2
    from speculators_compat_testbed.provenance import portable_command, provenance, scrub_paths

    rows = [_measure(s, n, args.hidden, args.reps) for s, n in zip(args.spans, args.rows_per_span)]
    result = {
        "provenance": provenance(),
        "command": portable_command(sys.argv),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "hidden": args.hidden,
        "rows": rows,
    }
    for r in rows:
        print(f"{r['spans']} spans x {r['rows_per_span']} rows: {r['host_launch_per_span_us']:.1f} us host per span, "
              f"{r['host_launch_marginal_per_span_us']:.1f} us per extra span "
              f"(per-span loop {r['host_launch_median_s']['per_span'] * 1e3:.2f} ms, one copy "
              f"{r['host_launch_median_s']['coalesced'] * 1e3:.3f} ms), rows equal {r['copied_rows_equal']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(scrub_paths(result), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
