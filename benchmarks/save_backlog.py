"""Host memory and throughput of the script's saves: speculators' own pattern vs the shim's queue.

speculators' ``data_generation_offline.py`` hands every sample to a 4-thread pool without bound;
``script-resumable-output`` saves through ``output.SaveQueue`` (at most SPECULATORS_COMPAT_SAVE_BUFFER_MB
waiting). A producer makes samples as fast as it can (clones of one sample: the generator's output
is a fresh tensor each time); the "disk" is real files in a folder, slowed to a set bandwidth by a
sleep per byte after each write (``--disk-mbps``; 0 = as fast as this disk). Reported per mode:
peak RSS growth over the run's start (sampled every 5 ms), wall time, samples/s. Modes alternate
within one process, a warm-up round apart:

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


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class Sampler:
    def __init__(self):
        self.base, self.peak, self._stop = rss_bytes(), 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes() - self.base)
            time.sleep(0.005)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return max(self.peak, rss_bytes() - self.base)


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


def run_speculators(template: dict, n: int, folder: Path, mbps: float) -> None:
    """The released script's loop: submit every sample to ThreadPoolExecutor(4), wait at the end."""
    import torch

    save = throttled(lambda obj, path: torch.save(obj, path), mbps)
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = []
        for i in range(n):
            obj = {k: ([h.clone() for h in v] if k == "hidden_states" else v) for k, v in template.items()}
            futures.append(pool.submit(save, obj, folder / f"data_{i}.pt"))
        for f in as_completed(futures):
            f.result()


def run_queue(template: dict, n: int, folder: Path, mbps: float, limit_mb: float) -> int:
    from speculators_compat import output

    real = output.save_tensor_file
    output.save_tensor_file = throttled(real, mbps)
    try:
        m = output.Manifest(folder)
        m.start({"num_samples": n, "start_idx": 0}, fsync=False)
        q = output.SaveQueue(m, workers=4, limit_bytes=int(limit_mb * 2**20), fsync=False)
        for i in range(n):
            obj = {k: ([h.clone() for h in v] if k == "hidden_states" else v) for k, v in template.items()}
            q.submit(i, output.data_name(i), obj, len(obj["input_ids"]), [0, 1, 2, 3])
        q.drain()
        return q.peak_inflight
    finally:
        output.save_tensor_file = real


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
    args = ap.parse_args()

    import torch

    from speculators_compat.testing.provenance import provenance

    template = {"input_ids": torch.arange(args.tokens), "loss_mask": torch.ones(args.tokens, dtype=torch.long),
                "hidden_states": [torch.randn(args.tokens, args.hidden).to(torch.bfloat16) for _ in range(args.layers)]}
    sample_mb = args.tokens * args.hidden * args.layers * 2 / 2**20
    root = Path(tempfile.mkdtemp(prefix="save_backlog."))
    results = []
    try:
        for mbps in args.disk_mbps:
            rows = {"speculators": [], "queue": []}
            order = ["speculators", "queue"]
            for rep in range(args.reps + 1):  # rep 0: warm-up, not reported
                for mode in (order if rep % 2 == 0 else order[::-1]):
                    folder = root / f"{mode}-{rep}"
                    folder.mkdir()
                    sampler = Sampler()
                    t0 = time.perf_counter()
                    peak_q = None
                    if mode == "speculators":
                        run_speculators(template, args.samples, folder, mbps)
                    else:
                        peak_q = run_queue(template, args.samples, folder, mbps, args.limit_mb)
                    wall = time.perf_counter() - t0
                    peak = sampler.stop()
                    shutil.rmtree(folder)
                    if rep:
                        rows[mode].append({"wall_s": wall, "samples_per_s": args.samples / wall,
                                           "peak_rss_growth_mb": peak / 2**20,
                                           **({"queue_peak_backlog_mb": peak_q / 2**20} if peak_q is not None else {})})
                    print(f"disk {mbps or 'unthrottled'} MB/s rep {rep} {mode:<11} {wall:6.2f} s  "
                          f"peak RSS +{peak / 2**20:7.0f} MB", file=sys.stderr)
            summary = {mode: {"median_wall_s": statistics.median(r["wall_s"] for r in v),
                              "median_peak_rss_growth_mb": statistics.median(r["peak_rss_growth_mb"] for r in v),
                              "max_peak_rss_growth_mb": max(r["peak_rss_growth_mb"] for r in v)}
                       for mode, v in rows.items()}
            summary["queue_over_speculators_wall"] = summary["queue"]["median_wall_s"] / summary["speculators"]["median_wall_s"]
            results.append({"disk_mbps": mbps or None, "reps": rows, "summary": summary})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = {"benchmark": "save_backlog", "provenance": provenance(),
           "shape": {"samples": args.samples, "tokens": args.tokens, "hidden": args.hidden, "layers": args.layers,
                     "sample_mb": sample_mb, "produced_mb": sample_mb * args.samples},
           "queue_limit_mb": args.limit_mb, "torch": torch.__version__, "results": results}
    text = json.dumps(out, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
