"""Host memory and throughput of the script's saves: speculators' own pattern vs the shim's queue.

speculators' ``data_generation_offline.py`` hands every sample to a 4-thread pool without bound;
``script-resumable-output`` saves through ``output.SaveQueue`` (at most SPECULATORS_COMPAT_SAVE_BUFFER_MB
waiting). A producer makes samples as fast as it can (clones of one sample: the generator's output
is a fresh tensor each time); the "disk" is real files in a folder, slowed to a set bandwidth by a
sleep that makes all threads share one disk of ``--disk-mbps`` MB/s (0 = as fast as this disk).
Each run is a fresh process (its peak RSS is the kernel's high-water mark, VmHWM, over the RSS
after torch and the template sample are loaded); reported per mode: peak RSS growth, the largest
backlog of samples handed over but not yet written (bytes, counted), wall time. Modes:
``speculators`` (the script's pool), ``queue`` (the shim's, with SHA-256), ``queue-nohash`` (the
shim's queue saving with plain torch.save: the checksum's share). Modes alternate, a warm-up round
apart:

    python benchmarks/save_backlog.py --out benchmarks/results/cpu/save_backlog.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path


def status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise LookupError(field)


def throttled(save, mbps: float):
    """``save`` on a disk of ``mbps`` MB/s shared by every thread: each write is done when the disk,
    writing one file after another, would have finished it."""
    lock, clock = threading.Lock(), [0.0]

    def slow(obj, path, *a, **k):
        out = save(obj, path, *a, **k)
        if mbps:
            size = Path(path).stat().st_size
            with lock:
                clock[0] = max(clock[0], time.perf_counter()) + size / (mbps * 1e6)
                done = clock[0]
            time.sleep(max(0.0, done - time.perf_counter()))
        return out
    return slow


def run_speculators(template: dict, n: int, folder: Path, mbps: float) -> int:
    """The released script's loop: submit every sample to ThreadPoolExecutor(4), wait at the end."""
    import torch

    nbytes = sum(t.numel() * t.element_size() for t in template["hidden_states"])
    lock, pending, peak = threading.Lock(), [0], [0]

    def save(obj, path):
        torch.save(obj, path)

    slow = throttled(save, mbps)

    def counted(obj, path):
        try:
            return slow(obj, path)
        finally:
            with lock:
                pending[0] -= 1

    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = []
        for i in range(n):
            obj = {k: ([h.clone() for h in v] if k == "hidden_states" else v) for k, v in template.items()}
            with lock:
                pending[0] += 1
                peak[0] = max(peak[0], pending[0])
            futures.append(pool.submit(counted, obj, folder / f"data_{i}.pt"))
        for f in as_completed(futures):
            f.result()
    return peak[0] * nbytes


def run_queue(template: dict, n: int, folder: Path, mbps: float, limit_mb: float, checksum: bool) -> int:
    import torch

    from speculators_compat import output

    def plain(obj, path, fsync=False):
        torch.save(obj, path)
        return path.stat().st_size, ""

    output.save_tensor_file = throttled(output.save_tensor_file if checksum else plain, mbps)
    m = output.Manifest(folder)
    m.start({"num_samples": n, "start_idx": 0}, fsync=False)
    q = output.SaveQueue(m, workers=4, limit_bytes=int(limit_mb * 2**20), fsync=False)
    for i in range(n):
        obj = {k: ([h.clone() for h in v] if k == "hidden_states" else v) for k, v in template.items()}
        q.submit(i, output.data_name(i), obj, len(obj["input_ids"]), [0, 1, 2, 3])
    q.drain()
    return q.peak_inflight


def one(args) -> dict:
    """One run in this (fresh) process."""
    import torch

    template = {"input_ids": torch.arange(args.tokens), "loss_mask": torch.ones(args.tokens, dtype=torch.long),
                "hidden_states": [torch.randn(args.tokens, args.hidden).to(torch.bfloat16) for _ in range(args.layers)]}
    folder = Path(tempfile.mkdtemp(prefix="save_backlog."))
    try:
        base = status_kb("VmRSS")
        t0 = time.perf_counter()
        if args.one == "speculators":
            backlog = run_speculators(template, args.samples, folder, args.disk)
        else:
            backlog = run_queue(template, args.samples, folder, args.disk, args.limit_mb, args.one == "queue")
        wall = time.perf_counter() - t0
        return {"mode": args.one, "wall_s": wall, "samples_per_s": args.samples / wall,
                "peak_rss_growth_mb": (status_kb("VmHWM") - base) / 1024, "peak_backlog_mb": backlog / 2**20}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=120)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--disk-mbps", type=float, nargs="+", default=[150.0, 0.0])
    ap.add_argument("--limit-mb", type=float, default=256.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--disk", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args)))
        return 0

    import subprocess

    from speculators_compat_testbed.provenance import provenance

    sample_mb = args.tokens * args.hidden * args.layers * 2 / 2**20
    modes = ["speculators", "queue", "queue-nohash"]
    results = []
    for mbps in args.disk_mbps:
        rows: dict[str, list] = {m: [] for m in modes}
        for rep in range(args.reps + 1):  # rep 0: warm-up (page cache, disk), not reported
            for mode in (modes if rep % 2 == 0 else modes[::-1]):
                cmd = [sys.executable, __file__, "--one", mode, "--disk", str(mbps), "--samples", str(args.samples),
                       "--tokens", str(args.tokens), "--hidden", str(args.hidden), "--layers", str(args.layers),
                       "--limit-mb", str(args.limit_mb)]
                r = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
                print(f"disk {mbps or 'unthrottled'} MB/s rep {rep} {mode:<12} {r['wall_s']:6.2f} s  "
                      f"RSS +{r['peak_rss_growth_mb']:6.0f} MB  backlog {r['peak_backlog_mb']:6.0f} MB", file=sys.stderr)
                if rep:
                    rows[mode].append(r)
        summary = {m: {"median_wall_s": statistics.median(r["wall_s"] for r in v),
                       "median_peak_rss_growth_mb": statistics.median(r["peak_rss_growth_mb"] for r in v),
                       "max_peak_rss_growth_mb": max(r["peak_rss_growth_mb"] for r in v),
                       "max_peak_backlog_mb": max(r["peak_backlog_mb"] for r in v)} for m, v in rows.items()}
        for m in modes[1:]:
            summary[f"{m}_over_speculators_wall"] = summary[m]["median_wall_s"] / summary["speculators"]["median_wall_s"]
        results.append({"disk_mbps": mbps or None, "reps": rows, "summary": summary})
    out = {"benchmark": "save_backlog", "provenance": provenance(),
           "shape": {"samples": args.samples, "tokens": args.tokens, "hidden": args.hidden, "layers": args.layers,
                     "sample_mb": sample_mb, "produced_mb": sample_mb * args.samples},
           "queue_limit_mb": args.limit_mb, "results": results}
    text = json.dumps(out, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
