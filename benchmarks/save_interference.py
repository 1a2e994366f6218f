"""What the save threads take from the driver's thread: a Python loop's rate while samples are saved.

The script's driver (scheduler, batching) is Python on the main thread; ``output.SaveQueue``
saves on ``--workers`` threads. Samples of the 8B-like shape (``--tokens`` x ``--hidden`` x
``--layers`` bf16) are submitted at ``--rate-gbs`` (the generator's output rate; 0 = as fast as the
threads go) while the main thread counts loop turns; reported per mode: the loop's rate over its
rate with nothing saved, and the bytes saved per second. Modes alternate, a warm-up round apart,
each on its own pool whose threads (and their checksum helpers) start before the first trial:
``shim`` (``output.save_tensor_file`` as installed, on ``--workers`` threads), ``shim@save_workers``
(the same on ``output.save_workers(--workers)`` threads, as the script's run uses),
``writer+hash`` (the shim's save up to 2025ac5: torch.save through a file object that SHA-256s
what passes), ``file`` (a plain file object), ``path`` (torch.save to a path: its own C++
writer), ``path+read-hash`` (path, then ``output.file_sha256`` of the file read back in this
process, as the shim did up to src tree a94ab62), ``path+helper-hash`` (path, then the shim's
checksum helper process reads it back); ``queue`` (``output.SaveQueue`` on
``output.save_workers(--workers)`` threads, manifest included, the sample a plain tensor) and
``queue+saver`` (the same queue with the sample's hidden states in an exchange chunk, as the
generator returns them: the run's saver process writes them). Files go to ``--dir`` (default
$TMPDIR): a second disk shows its own speed.

    python benchmarks/save_interference.py --out benchmarks/results/cpu/save_interference.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MODES = ("idle", "shim", "shim@save_workers", "writer+hash", "file", "path", "path+read-hash", "path+helper-hash",
         "queue", "queue+saver")
QUEUES = ("queue", "queue+saver")


class _HashingWriter:
    """The shim's save path at src tree 2025ac5, kept here as a fixed baseline: a file object that hashes what passes."""

    def __init__(self, f):
        self._f, self.sha = f, hashlib.sha256()

    def write(self, b) -> int:
        self.sha.update(b)
        return self._f.write(b)

    def flush(self) -> None:
        self._f.flush()


def savers(folder: Path):
    import torch

    from speculators_compat import output

    def shim(obj, i):
        output.save_tensor_file(obj, folder / f"s{i}.pt")

    def writer_hash(obj, i):
        with open(folder / f"h{i}.pt", "wb") as f:
            torch.save(obj, _HashingWriter(f))

    def file(obj, i):
        with open(folder / f"f{i}.pt", "wb") as f:
            torch.save(obj, f)

    def path(obj, i):
        torch.save(obj, str(folder / f"p{i}.pt"))

    def path_read_hash(obj, i):
        p = folder / f"r{i}.pt"
        torch.save(obj, str(p))
        output.file_sha256(p)

    def path_helper_hash(obj, i):
        p = folder / f"x{i}.pt"
        torch.save(obj, str(p))
        output._digest_saved(p, False)

    return {"shim": shim, "shim@save_workers": shim, "writer+hash": writer_hash, "file": file, "path": path,
            "path+read-hash": path_read_hash, "path+helper-hash": path_helper_hash}


def spin(stop: threading.Event, out: list) -> None:
    n, d = 0, {}
    while not stop.is_set():
        for k in range(200):
            d[k % 17] = k * 2
        n += 1
    out.append(n)


def started_pool(workers: int) -> ThreadPoolExecutor:
    """A pool whose every thread is running, with its checksum helper started (as in a long job)."""
    from speculators_compat import output

    pool, barrier = ThreadPoolExecutor(workers), threading.Barrier(workers)
    for f in [pool.submit(lambda: (barrier.wait(), output._helper())) for _ in range(workers)]:
        f.result()
    return pool


class Queued:
    """An ``output.SaveQueue`` kept across trials (its saver process started once, as in a job):
    ``trial`` submits to it and waits until every sample is saved."""

    def __init__(self, folder: Path, workers: int, sample: dict, exchange):
        from speculators_compat import output

        self.folder, self.sample, self.n = folder, sample, 0
        folder.mkdir()
        manifest = output.Manifest(folder)
        manifest.start({"format": output.FORMAT, "benchmark": "save_interference"}, False)
        self.queue = output.SaveQueue(manifest, output.save_workers(workers), 8 << 30, False,
                                      shared=None if exchange is None else (lambda: exchange))

    def submit(self, i: int) -> None:
        from speculators_compat import output

        self.n += 1
        self.queue.submit(self.n, output.data_name(self.n), self.sample, 1, [])

    def wait(self) -> None:
        with self.queue._cond:
            while self.queue._pending:
                self.queue._cond.wait()
        self.queue._raise()

    def clean(self) -> None:
        for p in self.folder.glob("data_*.pt"):
            p.unlink()


def in_exchange(sample: dict, exchange) -> dict:
    """``sample`` with its hidden states copied into leased segments of ``exchange`` (generator-style views)."""
    import torch

    states = []
    for k, t in enumerate(sample["hidden_states"]):
        nbytes = t.numel() * t.element_size()
        placements, _, _ = exchange.allocate({k: nbytes})
        view = torch.frombuffer(exchange.lease_view(placements[k], nbytes), dtype=t.dtype).view(t.shape)
        view.copy_(t)
        states.append(view)
    return dict(sample, hidden_states=states)


def trial(save, sample: dict, nbytes: int, n: int, pool, rate_gbs: float, idle_s: float) -> dict:
    stop, turns = threading.Event(), []
    t0 = time.perf_counter()
    th = threading.Thread(target=spin, args=(stop, turns))
    th.start()
    if save is None:
        time.sleep(idle_s)
    elif isinstance(save, Queued):
        for i in range(n):
            if rate_gbs:
                time.sleep(max(0.0, t0 + i * nbytes / (rate_gbs * 1e9) - time.perf_counter()))
            save.submit(i)
        save.wait()
    else:
        futures = []
        for i in range(n):
            if rate_gbs:
                time.sleep(max(0.0, t0 + i * nbytes / (rate_gbs * 1e9) - time.perf_counter()))
            futures.append(pool.submit(save, sample, i))
        for f in futures:
            f.result()
    wall = time.perf_counter() - t0
    stop.set()
    th.join()
    return {"loop_per_s": turns[0] / wall, "wall_s": wall, "gb_per_s": 0.0 if save is None else n * nbytes / wall / 1e9}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rate-gbs", type=float, default=1.4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    from speculators_compat import output
    from speculators_compat_testbed.provenance import provenance

    sample = {"input_ids": torch.arange(args.tokens), "loss_mask": torch.ones(args.tokens, dtype=torch.long),
              "hidden_states": [torch.randn(args.tokens, args.hidden, dtype=torch.bfloat16) for _ in range(args.layers)]}
    nbytes = sum(t.numel() * t.element_size() for t in sample["hidden_states"])
    folder = Path(tempfile.mkdtemp(prefix="save-interference-", dir=args.dir))
    try:
        fns = savers(folder)
        from speculators_compat.exchange import ExchangePool

        exchange = ExchangePool()
        fns["queue"] = Queued(folder / "queue", args.workers, sample, None)
        fns["queue+saver"] = Queued(folder / "queue+saver", args.workers, in_exchange(sample, exchange), exchange)
        idle_s = args.samples * nbytes / (args.rate_gbs * 1e9) if args.rate_gbs else 1.0
        pools = {m: started_pool(output.save_workers(args.workers) if m == "shim@save_workers" else args.workers)
                 for m in MODES if m not in QUEUES}
        for m in MODES[1:]:  # warm-up (the saver process starts here)
            trial(fns[m], sample, nbytes, 8, pools.get(m), 0.0, 0.0)
        runs: dict[str, list] = {m: [] for m in MODES}
        for _ in range(args.reps):
            for m in MODES:
                runs[m].append(trial(fns.get(m), sample, nbytes, args.samples, pools.get(m), args.rate_gbs, idle_s))
                for p in folder.iterdir():
                    if p.is_file():
                        p.unlink()
                for q in QUEUES:
                    fns[q].clean()
        for pool in pools.values():
            pool.shutdown()
        for q in QUEUES:
            fns[q].queue.drain()
        saver_files = {q: fns[q].queue.saved_by_saver for q in QUEUES}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    base = statistics.median(r["loop_per_s"] for r in runs["idle"])
    summary = {m: {"loop_rate_vs_idle": round(statistics.median(r["loop_per_s"] for r in v) / base, 4),
                   "gb_per_s": round(statistics.median(r["gb_per_s"] for r in v), 3)} for m, v in runs.items()}
    result = {"benchmark": "save_interference", "provenance": provenance(), "cpu_count": os.cpu_count(),
              "save_workers": output.save_workers(args.workers),
              "settings": {**vars(args), "dir": "TMPDIR" if args.dir is None else "given", "sample_bytes": nbytes},
              "saved_by_saver_process": saver_files, "summary": summary, "runs": runs}
    for m, s in summary.items():
        print(f"{m:12s} loop {s['loop_rate_vs_idle']:.3f} of idle   saved {s['gb_per_s']:.2f} GB/s")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
