"""Data-parallel extraction: one generator per GPU group, as Ray actors, over shards of a dataset.

``extract(model, layer_ids=, shards=, out_dir=, num_actors=, ...)`` writes speculators' own
``data_<i>.pt`` files; a finished shard leaves a marker and is skipped on a re-run, any other is
redone from its start. A dead actor ends ``extract`` with ``ExtractionError`` naming the shard,
actor, pid and cause; the rest are stopped. ``extract_local`` is the single-generator reference.
Ray is imported only here (``pip install 'speculators-compat[ray]'``). Details: docs/MODULES.md.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from speculators_compat.extraction.errors import ExtractionError, context, describe_exception

__all__ = ["extract", "extract_local", "plan", "pending", "run_shard", "ShardSpec"]

MARKER_DIR = ".shards"
KILL_GRACE_S = 10.0
FILE_PATTERN = "data_{idx}.pt"


class ShardSpec:
    """Shard ``index``: ``count`` samples whose files are ``data_<first>`` … ``data_<first+count-1>``."""

    __slots__ = ("index", "first", "count", "digest")

    def __init__(self, index: int, first: int, count: int, digest: str):
        self.index, self.first, self.count, self.digest = index, first, count, digest

    def marker(self, out_dir: Path) -> Path:
        return Path(out_dir) / MARKER_DIR / f"shard_{self.index:06d}.json"

    def as_dict(self) -> dict:
        return {"index": self.index, "first": self.first, "count": self.count, "digest": self.digest}


def _ids_and_mask(sample) -> tuple[list[int], Any]:
    if isinstance(sample, dict):
        if "input_ids" not in sample:
            raise ValueError(f"a sample dict needs 'input_ids'; found keys {sorted(sample)}")
        ids, mask = sample["input_ids"], sample.get("loss_mask")
    else:
        ids, mask = sample, None
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    ids = list(ids)
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError("every sample must be a non-empty sequence of integer token ids")
    return ids, mask


def _digest(samples, layer_ids) -> str:
    h = hashlib.sha256(json.dumps(list(layer_ids) if layer_ids is not None else None).encode())
    for sample in samples:
        ids, _ = _ids_and_mask(sample)
        h.update(len(ids).to_bytes(8, "little"))
        h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in ids))
    return h.hexdigest()[:32]


def plan(shards: Iterable[list], layer_ids=None, start_idx: int = 0) -> list[ShardSpec]:
    """Each shard's file range and input digest, in order."""
    specs, first = [], start_idx
    for k, samples in enumerate(shards):
        samples = list(samples)
        if not samples:
            raise ValueError(f"shard {k} is empty")
        specs.append(ShardSpec(k, first, len(samples), _digest(samples, layer_ids)))
        first += len(samples)
    return specs


def _read_marker(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def pending(specs: list[ShardSpec], out_dir) -> list[ShardSpec]:
    """The shards without a marker naming the same inputs (finished shards are skipped)."""
    todo = []
    for spec in specs:
        done = _read_marker(spec.marker(Path(out_dir)))
        if not done or any(done.get(k) != v for k, v in spec.as_dict().items()):
            todo.append(spec)
    return todo


def _save_as(save: Callable[[dict, str], object], data: dict, path: str) -> None:
    save(data, path)


def _atomic_write(path: Path, write: Callable[[str], object]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(str(tmp))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _torch_save(data, path) -> None:
    import torch

    torch.save(data, path)


def run_shard(generator, spec: ShardSpec, samples: list, out_dir, batch_size: int = 8,
              save: Callable[[dict, str], object] | None = None) -> dict:
    """Generate one shard with ``generator`` (``generate(token_ids)``, speculators' contract),
    write its files (``save(data, path)``, default ``torch.save``), then its marker; returns the
    shard's statistics."""
    save = save or _torch_save
    out = Path(out_dir)
    (out / MARKER_DIR).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tokens = 0
    idx = spec.first
    for start in range(0, len(samples), batch_size):
        batch = [_ids_and_mask(s) for s in samples[start : start + batch_size]]
        results = generator.generate([ids for ids, _ in batch])
        if len(results) != len(batch):
            raise RuntimeError(f"shard {spec.index}: the generator returned {len(results)} results for {len(batch)} samples")
        for (_, mask), result in zip(batch, results):
            n = len(result["input_ids"])
            if mask is not None:
                mask = mask[:n]
            data = {
                "input_ids": result["input_ids"],
                "hidden_states": [h.contiguous() if hasattr(h, "contiguous") else h for h in result["hidden_states"]],
                "loss_mask": mask,
            }
            _atomic_write(out / FILE_PATTERN.format(idx=idx), functools.partial(_save_as, save, data))
            tokens += n
            idx += 1
    seconds = time.perf_counter() - t0
    stats = {**spec.as_dict(), "tokens": tokens, "seconds": round(seconds, 6), "tok_per_s": round(tokens / seconds, 1) if seconds > 0 else None}
    _atomic_write(spec.marker(out), lambda p: Path(p).write_text(json.dumps(stats)))
    return stats


def _line(stats: dict, total: int, who: str) -> str:
    return (
        f"shard {stats['index'] + 1}/{total} done{who}: {stats['count']} samples, {stats['tokens']} tokens "
        f"in {stats['seconds']:.2f}s ({stats['tok_per_s']} tok/s)"
    )


def extract_local(generator, shards, out_dir, *, layer_ids=None, batch_size: int = 8, start_idx: int = 0,
                  progress: Callable[[str], None] | None = print, save=None) -> dict:
    """The same shard loop as ``extract``, in this process, with ``generator``."""
    shards = [list(s) for s in shards]
    specs = plan(shards, layer_ids if layer_ids is not None else getattr(generator, "layer_ids", None), start_idx)
    todo = pending(specs, out_dir)
    done = []
    t0 = time.perf_counter()
    for spec in todo:
        stats = run_shard(generator, spec, shards[spec.index], out_dir, batch_size, save)
        done.append(stats)
        if progress:
            progress(_line(stats, len(specs), ""))
    return _summary(specs, todo, done, time.perf_counter() - t0)


def _summary(specs, todo, done, seconds) -> dict:
    tokens = sum(s["tokens"] for s in done)
    return {
        "shards": len(specs),
        "skipped": len(specs) - len(todo),
        "computed": len(done),
        "samples": sum(s["count"] for s in done),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tok_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
        "per_shard": done,
    }


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for e in entries:
        try:
            with open(f"/proc/{e}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(e))
    out, stack = [], [pid]
    while stack:
        for c in children.get(stack.pop(), []):
            out.append(c)
            stack.append(c)
    return sorted(out)


def _reap(recorded: list[dict], grace: float = KILL_GRACE_S) -> list[int]:
    """SIGKILL every recorded pid on this host still running (same start time) after ``grace``
    seconds; returns the pids it had to kill."""
    import signal
    import socket

    host = socket.gethostname()
    mine = {}
    for rec in recorded:
        if rec.get("host") == host:
            mine[rec["pid"]] = rec.get("start")
            mine.update({int(p): t for p, t in rec.get("descendants", {}).items()})
    live = lambda: [p for p, t in mine.items() if t is not None and _start_time(p) == t]  # noqa: E731
    deadline = time.monotonic() + grace
    while live() and time.monotonic() < deadline:
        time.sleep(0.1)
    killed = []
    for p in live():
        try:
            os.kill(p, signal.SIGKILL)
            killed.append(p)
        except OSError:
            pass
    return killed


class _Extractor:
    """A Ray actor's body: one generator, kept for every shard the actor is handed."""

    def __init__(self, model, layer_ids, generator_kwargs, env):
        os.environ.update(env or {})
        import speculators_compat  # noqa: F401  (before speculators: activates the shim)
        from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

        self.generator = VllmHiddenStatesGenerator(model, layer_ids=layer_ids, **(generator_kwargs or {}))

    def run(self, spec: dict, samples, out_dir, batch_size):
        return run_shard(self.generator, ShardSpec(**spec), samples, out_dir, batch_size)

    def pids(self) -> dict:
        """This actor's pid and host and its descendants (the vLLM workers), each with its start time."""
        import socket

        return {"pid": os.getpid(), "host": socket.gethostname(), "start": _start_time(os.getpid()),
                "descendants": {p: _start_time(p) for p in _descendants(os.getpid())}}

    def close(self):
        gen, self.generator = self.generator, None
        executor = getattr(gen, "executor", None)
        if executor is not None:
            executor.shutdown()
        return True


def extract(model: str, layer_ids, shards, out_dir, *, num_actors: int = 1, batch_size: int = 8,
            tensor_parallel_size: int = 1, max_model_len: int = 2048, generator_kwargs: dict | None = None,
            gpus_per_actor: float | None = None, cpus_per_actor: float = 1,
            actor_env: dict | Callable[[int], dict] | None = None, ray_address: str | None = None,
            start_idx: int = 0, progress: Callable[[str], None] | None = print) -> dict:
    """Extract hidden states for ``shards`` with ``num_actors`` generators on Ray (see module doc).

    Returns a summary: shards, skipped (finished before), computed, samples, tokens, seconds,
    tok_per_s and each computed shard's statistics."""
    if num_actors < 1:
        raise ValueError(f"num_actors must be at least 1; got {num_actors}")
    try:
        import ray
    except ImportError as exc:
        raise ImportError(f"data-parallel extraction runs on Ray: pip install 'speculators-compat[ray]' ({exc})") from None

    shards = [list(s) for s in shards]
    specs = plan(shards, layer_ids, start_idx)
    out = Path(out_dir).resolve()
    (out / MARKER_DIR).mkdir(parents=True, exist_ok=True)
    todo = pending(specs, out)
    t0 = time.perf_counter()
    if progress and len(todo) < len(specs):
        progress(f"{len(specs) - len(todo)}/{len(specs)} shard(s) already finished: skipped")
    if not todo:
        return _summary(specs, todo, [], 0.0)

    started = False
    if not ray.is_initialized():
        ray.init(address=ray_address, ignore_reinit_error=True, log_to_driver=False)
        started = True
    if gpus_per_actor is None:
        gpus_per_actor = tensor_parallel_size if ray.cluster_resources().get("GPU", 0) else 0
    kwargs = {"tensor_parallel_size": tensor_parallel_size, "max_model_len": max_model_len, **(generator_kwargs or {})}
    Actor = ray.remote(num_cpus=cpus_per_actor, num_gpus=gpus_per_actor)(_Extractor)
    n = min(num_actors, len(todo))
    actors = []
    recorded: list[dict] = []
    done: list[dict] = []
    failed = False
    try:
        for i in range(n):
            env = actor_env(i) if callable(actor_env) else dict(actor_env or {})
            actors.append(Actor.remote(model, layer_ids, kwargs, env))
        for i, a in enumerate(actors):
            try:
                rec = ray.get(a.pids.remote())
            except ray.exceptions.RayError as exc:
                raise ExtractionError(f"actor {i} did not start its generator: {_cause(exc)}\n[{context()}]") from exc
            recorded.append(rec)
            if progress:
                progress(f"actor {i}: pid {rec['pid']} on {rec['host']}, descendant pid(s) {sorted(rec['descendants'])}")
        queue = list(todo)
        inflight: dict = {}

        def hand(actor_i):
            spec = queue.pop(0)
            ref = actors[actor_i].run.remote(spec.as_dict(), shards[spec.index], str(out), batch_size)
            inflight[ref] = (actor_i, spec)

        for i in range(n):
            if queue:
                hand(i)
        while inflight:
            ready, _ = ray.wait(list(inflight), num_returns=1)
            ref = ready[0]
            actor_i, spec = inflight.pop(ref)
            try:
                stats = ray.get(ref)
            except ray.exceptions.RayError as exc:
                rec = recorded[actor_i]
                what = "the actor died" if isinstance(exc, ray.exceptions.RayActorError) else "its generator failed"
                raise ExtractionError(
                    f"shard {spec.index} (files data_{spec.first}..data_{spec.first + spec.count - 1}) on actor "
                    f"{actor_i} (pid {rec['pid']} on {rec['host']}): {what}: {_cause(exc)}; the shard has no "
                    f"marker, the next extract redoes it\n[{context()}]") from exc
            done.append(stats)
            if progress:
                progress(_line(stats, len(specs), f" (actor {actor_i})"))
            if queue:
                hand(actor_i)
    except BaseException:
        failed = True
        raise
    finally:
        for a in actors:
            if not failed:
                try:
                    ray.get(a.close.remote(), timeout=120)
                except Exception:  # noqa: BLE001 - a failed actor is killed below either way
                    pass
            ray.kill(a)
        if started:
            ray.shutdown()
        if failed and recorded:
            killed = _reap(recorded)
            if progress and killed:
                progress(f"killed leftover pid(s) {killed}")
    done.sort(key=lambda s: s["index"])
    return _summary(specs, todo, done, time.perf_counter() - t0)


def _cause(exc: BaseException) -> str:
    """A Ray error's cause in one line: the actor's death or the task's own exception."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        return describe_exception(cause)
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else '(no message)'}"
