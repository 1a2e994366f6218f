"""Whole-job throughput: speculators' released script end to end vs the generator alone.

One model shape (the factory's Llama, chat tokenizer), one synthetic chat dataset with two size
classes (N conversations whose chat-templated length falls in 512-1024 tokens, N in 1024-2048).

A  speculators' own ``data_generation_offline.py`` (the released file, unmodified, from
   ``tests/e2e/speculators_scripts``, sha-checked) run under ``speculators-compat run`` as a
   subprocess: a fresh output folder and a fresh HF datasets cache every run, so preprocessing
   (chat template, tokenisation, loss masks) runs each time, as on a user's first run. The
   wall time of the whole job is split from the script's own log timestamps (ms):
   ``startup_s`` (process start to its first log line: imports), ``preprocess_s``,
   ``engine_init_s`` ("Initializing vLLM hidden states generator" to "Processing N/N samples":
   engine start + model load), ``generate_loop_s`` (the batch loop: ``generate`` + handing each
   sample to the 4-thread ``torch.save`` pool), ``save_drain_s`` (the saves still pending after
   the loop), ``finish_s`` (sample_lengths.json, data_config.json, exit). Tokens are the sum of
   the ``sample_lengths.json`` it writes.
B  the generator alone: ``VllmHiddenStatesGenerator(...).generate`` in this process (shim
   imported), same engine settings (max_model_len = --seq-length, same layer ids, same
   gpu_memory_utilization), on the token ids the script's preprocessing produced (read back from
   the warm-up run's ``data_*.pt`` files), in the script's batches and order; outputs dropped.

Ratios (A tokens/s over B tokens/s, per repetition, then median/min/max):
``ratio_generate_phase`` = tokens / (generate_loop_s + save_drain_s) / B: what the script's loop
and per-sample ``torch.save`` cost over ``generate``; ``ratio_ex_engine`` = tokens / (wall -
engine_init_s) / B: adds the process start, imports and preprocessing; ``ratio_job`` = tokens /
wall / B: the whole job, engine start included. Engine start + model load are reported apart
(A: every run's ``engine_init_s``; B: ``init_s`` once).

A and B alternate over --reps repetitions, the order rotating (rep r starts with side r mod 2).
The warm-up (one A run, which also yields the token ids, then B's engine start and one B pass)
is timed and reported apart. B's engine stays up (idle) while A's subprocess runs; vLLM's idle
workers wait on a socket, not spinning.

``--inproc-sides`` adds three in-process ablations of B (``pass_b``): S, the script's save path
(``output.SaveQueue`` on ``save_workers(4)`` threads with the exchange pool: the saver process
writes) fed by the generator; T, the same queue without the pool (every file saved by this
process's threads, as up to src tree d084725); H, outputs held two batches, not saved.
Before the repetitions, one untimed S pass grows the exchange pool to what saving holds (as in a
long job), so S, T and H meet the same pool. ``--fresh-side`` adds P, the generator alone in a fresh process (a new engine like the script's):
its first pass is as cold as the script's loop (``A_over_P_first``: the script against the
generator, both cold), its second as warm as B.
``--fp8-side`` adds F, the script with ``SPECULATORS_COMPAT_STORE_DTYPE=fp8``, to the rotation (its
ratios to B and its bytes per token against A's). ``--saver-side`` adds V, the script with
``SPECULATORS_COMPAT_SAVE_PROCESS=1`` (its files by the saver process; ``V_all_by_saver`` from its log).
The script reserves its exchange after the engine starts, before "Processing" (in ``engine_init_s``);
``*_ratio_generate_phase_with_reserve`` counts those seconds back into the generate phase.

    python benchmarks/job_throughput.py --hidden 128 --layers 4 --n 8 --batch-size 4 --reps 2 --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

CLASSES = ((512, 1024), (1024, 2048))

# the script's log lines that bound its phases (first occurrence each)
_MARKS = {
    "first": "EAGLE Offline Data Generation",
    "init": "Initializing vLLM hidden states generator",
    "processing": re.compile(r"Processing \d+/\d+ samples"),
    "wait": "Waiting for remaining file saves",
    "saved": re.compile(r"Saved \d+ new data points"),
    "done": "Data generation complete",
}
_TS = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) - ")


_TIMING = re.compile(r"speculators_compat timing: loop ([\d.]+) s over (\d+) batch\(es\): generate ([\d.]+) s "
                     r"\(first batch ([\d.]+) s\), waiting for saves ([\d.]+) s")


_INSIDE = re.compile(r"inside generate: begin ([\d.]+) s, steps ([\d.]+) s, finish ([\d.]+) s, the rest ([\d.]+) s; "
                     r"exchange: (\d+) chunk\(s\) made \((\d+) MiB\), (\d+) dropped")


_BY_SAVER = re.compile(r"\((\d+) written by the saver process")
_LEFT = re.compile(r"(\d+) MiB in (\d+) file\(s\) left at the loop's end, saved in ([\d.]+) s")
_RESERVED = re.compile(r"exchange reserved before the loop: (\d+) MiB \(\d+ x (\d+) tokens\) in ([\d.]+) s")


def _ts(match: re.Match) -> float:
    return time.mktime(time.strptime(match.group(1), "%Y-%m-%d %H:%M:%S")) + int(match.group(2)) / 1000


def parse_marks(text: str) -> dict[str, float]:
    """Epoch time of each mark: the timestamp of the log record whose message holds it (a
    message may continue on the lines after its timestamp, as the script's subsections do)."""
    found: dict[str, float] = {}
    last = None
    for line in re.split(r"[\r\n]", text):
        for m in _TS.finditer(line):
            last = _ts(m)
        if last is None:
            continue
        for name, pat in _MARKS.items():
            if name in found:
                continue
            if (pat.search(line) if isinstance(pat, re.Pattern) else pat in line):
                found[name] = last
    return found


def chat_rows(tokenizer, n: int, seed: int = 0) -> tuple[list[dict], list[int]]:
    """n conversations per size class, multi-turn (human/gpt), each grown turn by turn until its
    chat-templated length reaches a target drawn inside its class (32 tokens off each edge)."""
    from script_pipeline import _SENT

    rng = random.Random(seed)
    rows, lengths = [], []

    def length(conv):
        msgs = [{"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]} for t in conv]
        text = tokenizer.apply_chat_template(msgs, tokenize=False)
        return len(tokenizer(text, add_special_tokens=True)["input_ids"])

    for lo, hi in CLASSES:
        for _ in range(n):
            target = rng.randrange(lo + 32, hi - 32)
            conv = []
            while True:
                q = " ".join(rng.choice(_SENT) for _ in range(rng.randrange(1, 3)))
                a = ". ".join(rng.choice(_SENT) for _ in range(rng.randrange(2, 7)))
                trial = conv + [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
                n_tok = length(trial)
                if n_tok > target and conv:
                    break
                conv = trial
                if n_tok > target - 16:
                    break
            rows.append({"conversations": conv})
            lengths.append(length(conv))
    rng.shuffle(rows)
    return rows, lengths


def class_of(n_tok: int) -> str:
    for lo, hi in CLASSES:
        if lo <= n_tok < hi:
            return f"{lo}-{hi}"
    return "other"


class DirtyTrace:
    """The kernel's dirty and under-writeback page cache (/proc/meminfo Dirty, Writeback; MiB)
    every 0.1 s while a run goes on, epoch-stamped like the script's log: what a drain after the
    loop waits behind (writeback throttling) or not. Linux only; empty elsewhere."""

    def __init__(self, period: float = 0.1):
        import threading

        self.samples: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._period = period
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
                self.samples.append((time.time(), int(info["Dirty"].split()[0]) / 1024,
                                     int(info["Writeback"].split()[0]) / 1024))
            except (OSError, KeyError, ValueError):
                return
            self._stop.wait(self._period)

    def around(self, marks: dict) -> dict:
        """Dirty/Writeback (MiB) at the loop's end, their peaks in the loop and in the drain, and
        the kernel's dirty limits (vm.dirty_*)."""
        out: dict = {}
        for name in ("dirty_ratio", "dirty_background_ratio", "dirty_bytes", "dirty_background_bytes"):
            try:
                out[f"vm_{name}"] = int(Path(f"/proc/sys/vm/{name}").read_text())
            except (OSError, ValueError):
                pass
        def window(a, b):
            return [x for x in self.samples if a <= x[0] <= b]
        if "processing" in marks and "wait" in marks:
            loop = window(marks["processing"], marks["wait"])
            if loop:
                out["loop_dirty_peak_mib"] = max(x[1] for x in loop)
                out["loop_writeback_peak_mib"] = max(x[2] for x in loop)
                out["loop_end_dirty_mib"], out["loop_end_writeback_mib"] = loop[-1][1], loop[-1][2]
        if "wait" in marks and "saved" in marks:
            drain = window(marks["wait"], marks["saved"] + 0.1)
            if drain:
                out["drain_dirty_peak_mib"] = max(x[1] for x in drain)
                out["drain_writeback_peak_mib"] = max(x[2] for x in drain)
        out["samples"] = len(self.samples)
        return out


def run_script(args, script: Path, model: Path, data: Path, work: Path, tag: str, extra_env: dict | None = None) -> dict:
    """One end-to-end run of the released script under ``speculators-compat run``."""
    run_dir = work / tag
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    out_dir = run_dir / "out"
    cmd = [
        sys.executable, "-m", "speculators_compat", "run", sys.executable, str(script),
        "--target-model-path", str(model),
        "--train-data-path", str(data),
        "--output-dir", str(out_dir),
        "--seq-length", str(args.seq_length),
        "--batch-size", str(args.batch_size),
        "--gpu-memory-utilization", str(args.gpu_util),
        "--num-preprocessing-workers", str(args.preprocessing_workers),
        "--token-freq-path", str(run_dir / "token_freq.pt"),
        "--hf-cache-dir", str(run_dir / "hf_datasets"),
    ]
    if args.layer_ids:
        cmd += ["--layer-ids", *map(str, args.layer_ids)]
    env = dict(os.environ)
    env["HF_HUB_OFFLINE"] = "1"
    env["HF_DATASETS_OFFLINE"] = "1"
    env.update(extra_env or {})
    t_start = time.time()
    p0 = time.perf_counter()
    with DirtyTrace() as dirty:
        proc = subprocess.run(cmd, cwd=run_dir, env=env, capture_output=True, text=True, timeout=args.script_timeout)
    wall = time.perf_counter() - p0
    t_end = t_start + wall
    # beside the run's folder (removed after the run unless --keep): the script's own log survives
    (work / f"{tag}.script.log").write_text(proc.stderr + "\n--- stdout ---\n" + proc.stdout)
    res: dict = {"returncode": proc.returncode, "wall_s": wall}
    if proc.returncode != 0:
        res["stderr_tail"] = proc.stderr[-3000:]
        return res
    m = parse_marks(proc.stderr + "\n" + proc.stdout)
    t = _TIMING.search(proc.stderr + "\n" + proc.stdout)  # the shim's own line: where the loop's time went
    v = _BY_SAVER.search(proc.stderr + "\n" + proc.stdout)
    r = _RESERVED.search(proc.stderr + "\n" + proc.stdout)
    if r:  # made after the engine starts, before the loop: in engine_init_s, not the generate phase
        res["exchange_reserved"] = {"mib": int(r[1]), "tokens_per_call": int(r[2]), "seconds": float(r[3])}
    if v:
        res["files_by_saver_process"] = int(v[1])
    left = _LEFT.search(proc.stderr + "\n" + proc.stdout)
    if left:  # the shim's own count of what the drain after the loop waited for
        res["drain"] = {"left_mib": int(left[1]), "left_files": int(left[2]), "seconds": float(left[3])}
    res["page_cache"] = dirty.around(m)
    if t:
        res["loop_timing"] = {"loop_s": float(t[1]), "batches": int(t[2]), "generate_s": float(t[3]),
                              "first_batch_s": float(t[4]), "blocked_on_saves_s": float(t[5])}
    i = _INSIDE.search(proc.stderr + "\n" + proc.stdout)
    if i and "loop_timing" in res:
        res["loop_timing"].update({"begin_s": float(i[1]), "steps_s": float(i[2]), "finish_s": float(i[3]),
                                   "rest_s": float(i[4]), "chunks_made": int(i[5]), "chunk_mib_made": int(i[6]),
                                   "chunks_dropped": int(i[7])})
    missing = [k for k in _MARKS if k not in m]
    if missing:
        res["missing_marks"] = missing
    seg = {
        "startup_s": ("start", "first"),
        "preprocess_s": ("first", "init"),
        "engine_init_s": ("init", "processing"),
        "generate_loop_s": ("processing", "wait"),
        "save_drain_s": ("wait", "saved"),
        "finish_s": ("saved", "end"),
    }
    m2 = {"start": t_start, "end": t_end, **m}
    for k, (a, b) in seg.items():
        if a in m2 and b in m2:
            res[k] = m2[b] - m2[a]
    lengths = json.loads((out_dir / "sample_lengths.json").read_text())
    files = sorted(out_dir.glob("data_*.pt"), key=lambda p: int(p.stem[5:]))
    res["samples"] = len(lengths)
    res["files"] = len(files)
    res["tokens"] = sum(lengths.values())
    res["bytes_written"] = sum(f.stat().st_size for f in files)
    res["bytes_per_token"] = res["bytes_written"] / max(1, sum(lengths.values()))
    res["_lengths"] = [lengths[str(i)] for i in range(len(lengths))]
    res["_out_dir"] = out_dir
    res["_files"] = files
    res["_run_dir"] = run_dir
    tok = res["tokens"]
    res["tok_s_job"] = tok / wall
    if "engine_init_s" in res:
        res["tok_s_ex_engine"] = tok / (wall - res["engine_init_s"])
    if "generate_loop_s" in res and "save_drain_s" in res:
        res["generate_phase_s"] = res["generate_loop_s"] + res["save_drain_s"]
        res["tok_s_generate_phase"] = tok / res["generate_phase_s"]
    return res


_FRESH_CHILD = """
import json, sys, time
import speculators_compat
from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator
spec = json.load(open(sys.argv[1]))
t = time.perf_counter()
gen = VllmHiddenStatesGenerator(spec["model"], layer_ids=spec["layer_ids"], max_model_len=spec["seq_length"],
                                gpu_memory_utilization=spec["gpu_util"])
init_s, passes = time.perf_counter() - t, []
for _ in range(2):
    each = []
    for b in spec["batches"]:
        t = time.perf_counter()
        res = gen.generate(b)
        each.append(time.perf_counter() - t)
        del res
    passes.append(each)
print("FRESH_RESULT " + json.dumps({"init_s": init_s, "passes": passes}), flush=True)
import os
os._exit(0)
"""


def run_fresh(args, model: Path, batches: list, work: Path) -> dict:
    """P: the generator alone in a fresh process (a new engine, as the script's): two passes over the
    script's batches; the first pass is as cold as the script's loop, the second as warm as B."""
    spec = work / "fresh_spec.json"
    spec.write_text(json.dumps({"model": str(model), "layer_ids": args.layer_ids, "seq_length": args.seq_length,
                                "gpu_util": args.gpu_util, "batches": batches}))
    proc = subprocess.run([sys.executable, "-c", _FRESH_CHILD, str(spec)], capture_output=True, text=True,
                          timeout=args.script_timeout, env=dict(os.environ))
    m = re.search(r"^FRESH_RESULT (.*)$", proc.stdout, re.M)
    if proc.returncode != 0 or not m:
        return {"returncode": proc.returncode, "stderr_tail": proc.stderr[-3000:]}
    r = json.loads(m[1])
    tokens = sum(len(x) for b in batches for x in b)
    p1, p2 = sum(r["passes"][0]), sum(r["passes"][1])
    return {"returncode": 0, "init_s": r["init_s"], "first_pass_s": p1, "second_pass_s": p2,
            "first_pass_tok_s": tokens / p1, "second_pass_tok_s": tokens / p2, "batch_s": r["passes"]}


def read_ids(files: list[Path]) -> list[list[int]]:
    import torch

    out = []
    for f in files:
        d = torch.load(f, map_location="cpu", mmap=True, weights_only=True)
        ids = d["input_ids"]
        out.append([int(x) for x in (ids.tolist() if hasattr(ids, "tolist") else ids)])
    return out


def public(d: dict) -> dict:
    return {k: v for k, v in d.items() if not k.startswith("_")}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="llama")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--n", type=int, default=None, help="conversations per size class (default: 4 batches' worth)")
    p.add_argument("--batch-size", type=int, default=8, help="the script's --batch-size (its default 8)")
    p.add_argument("--seq-length", type=int, default=2048, help="the script's --seq-length (max_model_len)")
    p.add_argument("--layer-ids", type=int, nargs="+", default=None, help="default: speculators' own choice")
    p.add_argument("--gpu-util", type=float, default=0.4, help="gpu_memory_utilization of both A and B")
    p.add_argument("--preprocessing-workers", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--script", default=None, help="default: the copy for the installed speculators release")
    p.add_argument("--work", default=None, help="folder for the runs' data (default: a temp folder, removed)")
    p.add_argument("--keep", action="store_true", help="keep the runs' output files")
    p.add_argument("--script-timeout", type=float, default=600)
    p.add_argument("--out", default=None)
    p.add_argument("--fp8-side", action="store_true",
                   help="a third side F: the script with SPECULATORS_COMPAT_STORE_DTYPE=fp8, in the same rotation")
    p.add_argument("--saver-side", action="store_true",
                   help="a side V: the script with SPECULATORS_COMPAT_SAVE_PROCESS=1, in the same rotation")
    p.add_argument("--inproc-sides", action="store_true",
                   help="ablations in this process beside B: S (the script's save path) and H (outputs held)")
    p.add_argument("--fresh-side", action="store_true",
                   help="a side P: the generator alone in a fresh process (new engine), two passes")
    args = p.parse_args()
    n = args.n or 4 * args.batch_size

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import speculators_compat  # noqa: F401
    import torch
    from script_pipeline import installed_speculators, script_for
    from speculators_compat_testbed.tiny_models import build_tiny_model, vllm_env

    platform = "cuda" if torch.cuda.is_available() else "cpu"
    for k, v in vllm_env(args.arch, platform).items():
        os.environ.setdefault(k, v)
    script = Path(args.script).resolve() if args.script else script_for(installed_speculators())
    model = build_tiny_model(args.arch, num_layers=args.layers, hidden_size=args.hidden, dtype=args.dtype)
    work = Path(args.work or tempfile.mkdtemp(prefix="job-throughput-")).resolve()
    work.mkdir(parents=True, exist_ok=True)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    rows, templated = chat_rows(tok, n)
    data = work / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"dataset: {len(rows)} conversations, templated lengths {min(templated)}-{max(templated)}", flush=True)

    # warm-up A: also yields the token ids the script's preprocessing produced
    warm_a = run_script(args, script, model, data, work, "warmup_a")
    print(json.dumps({"warmup_A": public(warm_a)}), flush=True)
    if warm_a["returncode"] != 0:
        print(warm_a.get("stderr_tail", ""), file=sys.stderr)
        return 1
    ids = read_ids(warm_a["_files"])
    lengths = warm_a["_lengths"]
    assert [len(x) for x in ids] == lengths, "data_*.pt input_ids disagree with sample_lengths.json"
    if not args.keep:
        shutil.rmtree(warm_a["_run_dir"], ignore_errors=True)
    batches = [ids[i : i + args.batch_size] for i in range(0, len(ids), args.batch_size)]
    tokens = sum(lengths)
    by_class: dict[str, dict] = {}
    for L in lengths:
        c = by_class.setdefault(class_of(L), {"samples": 0, "tokens": 0, "min": L, "max": L})
        c["samples"] += 1
        c["tokens"] += L
        c["min"], c["max"] = min(c["min"], L), max(c["max"], L)

    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

    t = time.perf_counter()
    gen = VllmHiddenStatesGenerator(str(model), layer_ids=args.layer_ids, max_model_len=args.seq_length,
                                    gpu_memory_utilization=args.gpu_util)
    init_b = time.perf_counter() - t

    b_batch_s: list[list[float]] = []
    b_phases: list[dict] = []
    from speculators_compat import output as shim_output
    from speculators_compat.extraction.driver import POOL_ATTR, TIMINGS_ATTR

    def pass_b(mode: str = "B") -> float | dict:
        """B: outputs dropped at once. In-process ablations (--inproc-sides): S hands every sample to
        the script's own save path (``output.SaveQueue``: its 4 threads, 2 GiB in flight, files in
        ``work``); H holds each batch's outputs until two batches later (no saves)."""
        pool = getattr(gen, POOL_ATTR, None)
        before = dict(pool.stats) if pool is not None else {}
        phases = {"begin": 0.0, "steps": 0.0, "finish": 0.0}
        queue, held, folder = None, [], work / f"inproc_{mode}"
        if mode in ("S", "T"):
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            manifest = shim_output.Manifest(folder)
            manifest.start({"format": shim_output.FORMAT, "ablation": mode}, False)
            queue = shim_output.SaveQueue(manifest, shim_output.save_workers(4), 2048 << 20, False,
                                          shared=(lambda: getattr(gen, POOL_ATTR, None)) if mode == "S" else None)
            if queue._saver is not None:  # started before the pass, as the script starts it before the engine
                queue._saver.ready.wait(120)
        if platform == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        each, index = [], 0
        for b in batches:
            t1 = time.perf_counter()
            res = gen.generate(b)
            assert len(res) == len(b)
            each.append(time.perf_counter() - t1)
            timings = getattr(gen, TIMINGS_ATTR, None) or {}
            for k in phases:
                phases[k] += float(timings.get(k, 0.0))
            if queue is not None:
                for r in res:
                    n = len(r["input_ids"])
                    obj = {"input_ids": r["input_ids"], "hidden_states": [h.contiguous() for h in r["hidden_states"]],
                           "loss_mask": torch.ones(n, dtype=torch.long)}
                    queue.submit(index, shim_output.data_name(index), obj, n, [])
                    index += 1
            elif mode == "H":
                held.append(res)
                del held[:-2]
            del res
        if queue is not None:
            queue.drain()
        seconds = time.perf_counter() - t
        held.clear()
        shutil.rmtree(folder, ignore_errors=True)
        if mode == "B":
            b_batch_s.append(each)
            b_phases.append(phases)
            return seconds
        after = dict(pool.stats) if pool is not None else {}
        return {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds, "first_batch_s": each[0],
                "generate_s": sum(each), "phases_s": phases,
                "blocked_on_saves_s": queue.blocked_s if queue is not None else 0.0,
                "files_by_saver_process": queue.saved_by_saver if queue is not None else 0,
                "saver_failure": queue.saver_failure if queue is not None else None,
                "chunks_made": after.get("chunks_created", 0) - before.get("chunks_created", 0),
                "chunk_mib_made": (after.get("bytes_created", 0) - before.get("bytes_created", 0)) / 2**20}

    warm_b = pass_b()
    warm_s = pass_b("S") if args.inproc_sides else None  # the pool grown to what saving holds, once (a long job's state)
    print(json.dumps({"init_B_s": init_b, "warmup_B_s": warm_b}), flush=True)

    from speculators_compat_testbed.provenance import portable_command, portable_path, provenance, scrub_paths
    from speculators_compat.versions import installed_versions

    reps: list[dict] = []
    out = {
        "provenance": provenance(),
        "command": portable_command(),
        "complete": False,
        "platform": platform,
        "device": torch.cuda.get_device_name(0) if platform == "cuda" else os.uname().machine,
        "cpu_count": os.cpu_count(),
        "versions": {k: v.version for k, v in installed_versions().items()},
        "script": portable_path(script),
        "model": {"arch": args.arch, "hidden": args.hidden, "layers": args.layers, "dtype": args.dtype,
                  "layer_ids": list(getattr(gen, "layer_ids", []) or [])},
        "settings": {"batch_size": args.batch_size, "seq_length": args.seq_length, "gpu_util": args.gpu_util,
                     "preprocessing_workers": args.preprocessing_workers, "reps": args.reps,
                     "conversations_per_class": n, "kv_cache_bytes": os.environ.get("SPECULATORS_COMPAT_KV_CACHE_BYTES")},
        "data": {"conversations": len(rows), "samples": len(lengths), "tokens": tokens, "batches": len(batches),
                 "by_class": by_class},
        "warmup": {"A": public(warm_a), "B_init_s": init_b, "B_pass_s": warm_b, "B_tok_s": tokens / warm_b,
                   "S_pass": warm_s},
        "summary": None,
        "reps": reps,
    }

    def write() -> str:
        # after the warm-up and every repetition, so a run cut off by a time limit still leaves its numbers
        text = json.dumps(scrub_paths(out), indent=2, default=str)
        if args.out:
            Path(args.out).write_text(text)
        return text

    write()
    sides = ["A", "F", "B"] if args.fp8_side else ["A", "B"]
    if args.saver_side:
        sides.insert(1, "V")
    if args.inproc_sides:
        sides += ["S", "T", "H"]
    if args.fresh_side:
        sides += ["P"]
    for r in range(args.reps):
        order = sides[r % len(sides):] + sides[:r % len(sides)]
        rep: dict = {"order": order}
        for side in order:
            if side in ("A", "F", "V"):
                env = {"F": {"SPECULATORS_COMPAT_STORE_DTYPE": "fp8"}, "V": {"SPECULATORS_COMPAT_SAVE_PROCESS": "1"}}.get(side)
                a = run_script(args, script, model, data, work, f"rep{r}_{side.lower()}", env)
                if a["returncode"] != 0:
                    print(a.get("stderr_tail", ""), file=sys.stderr)
                    return 1
                a["same_samples_as_warmup"] = a["_lengths"] == lengths
                if not args.keep:
                    shutil.rmtree(a["_run_dir"], ignore_errors=True)
                rep[side] = public(a)
            elif side == "P":
                rep["P"] = run_fresh(args, model, batches, work)
                if rep["P"]["returncode"] != 0:
                    print(rep["P"].get("stderr_tail", ""), file=sys.stderr)
                    return 1
            elif side in ("S", "T", "H"):
                rep[side] = pass_b(side)
            else:
                s = pass_b()
                rep["B"] = {"seconds": s, "tokens": tokens, "tok_s": tokens / s, "first_batch_s": b_batch_s[-1][0],
                            "after_first_s": sum(b_batch_s[-1][1:]), "phases_s": b_phases[-1]}
        b = rep["B"]["tok_s"]
        a = rep["A"]
        rep["ratio_generate_phase"] = a.get("tok_s_generate_phase", float("nan")) / b
        rep["ratio_ex_engine"] = a.get("tok_s_ex_engine", float("nan")) / b
        rep["ratio_job"] = a["tok_s_job"] / b
        # warm-up apart: both sides without their first batch (A's engine is fresh; B's has run before)
        first_tokens = sum(len(x) for x in batches[0])
        b_steady = (tokens - first_tokens) / rep["B"]["after_first_s"]
        for side in ("A", "F", "V"):
            lt = rep.get(side, {}).get("loop_timing")
            if lt and "generate_phase_s" in rep[side]:
                rep[f"{side}_ratio_generate_phase_after_first_batch"] = (
                    (tokens - first_tokens) / (rep[side]["generate_phase_s"] - lt["first_batch_s"]) / b_steady)
        for side in ("S", "T", "H"):
            if side in rep:
                rep[f"{side}_ratio"] = rep[side]["tok_s"] / b
        if "S" in rep:  # S measures the saver only where it wrote every file
            rep["S_all_by_saver"] = rep["S"]["files_by_saver_process"] == sum(len(x) for x in batches)
        if "P" in rep:  # both on a fresh engine: the script's loop against the generator's first pass
            rep["P_first_over_B"] = rep["P"]["first_pass_tok_s"] / b
            rep["P_second_over_B"] = rep["P"]["second_pass_tok_s"] / b
            if "tok_s_generate_phase" in a:
                rep["A_over_P_first"] = a["tok_s_generate_phase"] / rep["P"]["first_pass_tok_s"]
            if "F" in rep and "tok_s_generate_phase" in rep["F"]:
                rep["F_over_P_first"] = rep["F"]["tok_s_generate_phase"] / rep["P"]["first_pass_tok_s"]
        for side in ("A", "V"):  # the exchange reserved before the loop counted back in (it moved, not went)
            got = rep.get(side, {})
            if "exchange_reserved" in got and "generate_phase_s" in got:
                rep[f"{side}_ratio_generate_phase_with_reserve"] = (
                    tokens / (got["generate_phase_s"] + got["exchange_reserved"]["seconds"]) / b)
        if "V" in rep:
            rep["V_ratio_generate_phase"] = rep["V"].get("tok_s_generate_phase", float("nan")) / b
            rep["V_all_by_saver"] = rep["V"].get("files_by_saver_process") == rep["V"].get("files")
        if "F" in rep:
            f = rep["F"]
            rep["F_ratio_generate_phase"] = f.get("tok_s_generate_phase", float("nan")) / b
            rep["F_ratio_job"] = f["tok_s_job"] / b
            rep["F_bytes_ratio"] = f["bytes_per_token"] / a["bytes_per_token"]
        reps.append(rep)
        print(json.dumps(rep), flush=True)
        write()

    def stats(vals):
        return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}

    summary = {
        "B_tok_s": stats([r["B"]["tok_s"] for r in reps]),
        "A_tok_s_generate_phase": stats([r["A"].get("tok_s_generate_phase", float("nan")) for r in reps]),
        "A_tok_s_ex_engine": stats([r["A"].get("tok_s_ex_engine", float("nan")) for r in reps]),
        "A_tok_s_job": stats([r["A"]["tok_s_job"] for r in reps]),
        "ratio_generate_phase": stats([r["ratio_generate_phase"] for r in reps]),
        "ratio_ex_engine": stats([r["ratio_ex_engine"] for r in reps]),
        "ratio_job": stats([r["ratio_job"] for r in reps]),
        "A_phase_median_s": {
            k: statistics.median(r["A"][k] for r in reps)
            for k in ("wall_s", "startup_s", "preprocess_s", "engine_init_s", "generate_loop_s", "save_drain_s", "finish_s")
            if all(k in r["A"] for r in reps)
        },
        "B_median_s": statistics.median(r["B"]["seconds"] for r in reps),
        "engine_init_s": {"A_median": statistics.median(r["A"]["engine_init_s"] for r in reps), "B": init_b},
        "A_bytes_per_token": statistics.median(r["A"]["bytes_per_token"] for r in reps),
    }
    for side in ("A", "F", "V"):
        key = f"{side}_ratio_generate_phase_after_first_batch"
        if all(key in r for r in reps):
            summary[key] = stats([r[key] for r in reps])
    for key in ("A_ratio_generate_phase_with_reserve", "V_ratio_generate_phase_with_reserve", "V_ratio_generate_phase", "S_ratio", "T_ratio", "H_ratio", "P_first_over_B", "P_second_over_B", "A_over_P_first", "F_over_P_first"):
        if all(key in r for r in reps):
            summary[key] = stats([r[key] for r in reps])
    if args.fp8_side:
        summary.update({
            "F_ratio_generate_phase": stats([r["F_ratio_generate_phase"] for r in reps]),
            "F_ratio_job": stats([r["F_ratio_job"] for r in reps]),
            "F_bytes_per_token": statistics.median(r["F"]["bytes_per_token"] for r in reps),
            "F_bytes_ratio": stats([r["F_bytes_ratio"] for r in reps]),
        })
    print(json.dumps(summary), flush=True)
    out["summary"] = summary
    out["complete"] = True
    text = write()
    print(text)
    if not args.keep and not args.work:
        shutil.rmtree(work, ignore_errors=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # a live engine (B) is not shut down through the interpreter's exit
