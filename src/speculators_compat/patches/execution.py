"""The generator's step loop: ``VllmHiddenStatesGenerator.generate``, replaced as a whole.

Why a whole method (not call adapters): every part of the loop moved, and both speculators
releases have bugs there that give wrong results without an error.
- vLLM 0.11.1+ split a step into ``execute_model`` (returns None) and ``sample_tokens``; calling
  ``execute_model`` twice raises "sample_tokens() must be called after execute_model() returns
  None" (speculators 0.3.0 never calls ``sample_tokens``; 0.4.x calls it where 0.11.0 lacks it).
- ``collective_rpc(..., unique_reply_rank=0)`` returns the single reply, not a list (0.3.0
  indexes it).
- Model Runner V2 (0.22+) frees a request's slot only when a SchedulerOutput carrying its id in
  ``finished_req_ids`` reaches the worker; the generators drop that output ("No free indices"
  after a few calls on the GPU).
- speculators 0.3.0 aborts every request after its first scheduled chunk: a batch larger than
  ``max_num_batched_tokens`` comes back truncated and misaligned (rel. error ~1.4 vs HF).
- speculators 0.4.x returns results in ``sorted()`` order of string ids: ``req_0_10`` sorts
  before ``req_0_2``, so batches of more than ten come back out of input order.
- Captured states cross the process boundary pickled in one RPC (most of the wall time on a GPU).

The replacement drives the engine the way vLLM's own ``EngineCore.step`` does (schedule →
execute_model → sample_tokens where needed → ``update_from_output``; requests finish by their
``max_tokens=1`` and their ids reach the workers), keeps speculators' contract — request ids
``req_{call}_{i}``, truncation to ``max_model_len - 1``, the logger, the result dicts
``{"input_ids", "hidden_states", "loss_mask"}`` in input order — and receives hidden states
in shared memory written in place by the worker (``worker_capture``), leased from a pool
that is mapped and page-locked once and recycled when results are dropped (``exchange``);
each call's phase timings are left on the generator (``_speculators_compat_timings``). Every sequence gets
exactly its (truncated) length for every layer, or the call raises.

Pipelining: where the executor takes ``non_block`` RPCs (vLLM's ``FutureWrapper`` queue, 0.11.1+;
probed on the executor's own ``execute_model``/``sample_tokens``), the driver keeps two batches in
flight like ``EngineCore.step_with_batch_queue``: batch N+1 is scheduled and submitted before
batch N's output is awaited. vLLM's plain ``Scheduler`` allows this (pipeline parallelism uses
it): it advances ``num_computed_tokens`` when it schedules, and a request whose last prompt chunk
is in flight has nothing left to schedule until its output arrives. With the workers in async
scheduling mode (the ``async-scheduling`` patch, accelerators only) a worker prepares batch N+1
while the device still computes batch N. ``SPECULATORS_COMPAT_PIPELINE=0`` drives one batch at
a time (the earlier serial driver, kept for comparison and for executors without futures).
"""

from __future__ import annotations

import sys
from collections import deque
from numbers import Integral
import time

from .. import settings
from ..exchange import ExchangePool
from ..registry import wrapper_patch
from ._signatures import GENERATOR, import_attr, parameters
from .worker_capture import RPC_NAME

POOL_ATTR = "_speculators_compat_pool"
TIMINGS_ATTR = "_speculators_compat_timings"

__all__ = ["ExtractionError", "generate"]


class ExtractionError(RuntimeError):
    """A failure during extraction, with its type, message, origin and the shim's context."""


def _context() -> str:
    try:
        import speculators_compat

        return speculators_compat.context_line()
    except Exception:  # noqa: BLE001
        return "speculators-compat context unavailable"


def describe_exception(exc: BaseException) -> str:
    message = str(exc)
    if not message:
        import traceback

        frames = traceback.extract_tb(exc.__traceback__)
        if frames:
            last = frames[-1]
            message = f"(no message) raised at {last.filename}:{last.lineno} in {last.name}: {last.line}"
        else:
            message = "(no message)"
    return f"{type(exc).__name__}: {message}"


def worker_health(executor) -> str | None:
    """A line naming every vLLM worker process that is dead (and how it ended) or stopped."""
    import signal

    dead = []
    for handle in getattr(executor, "workers", None) or []:
        proc = getattr(handle, "proc", None)
        if proc is None:
            continue
        try:
            alive = proc.is_alive()
            code = proc.exitcode
        except Exception:  # noqa: BLE001 - a handle we cannot query says nothing
            continue
        if alive:
            if _proc_state(getattr(proc, "pid", None)) in ("T", "t"):
                dead.append(f"rank {getattr(handle, 'rank', '?')} (pid {proc.pid}) is stopped (SIGSTOP / traced)")
            continue
        if code is not None and code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        dead.append(f"rank {getattr(handle, 'rank', '?')} (pid {getattr(proc, 'pid', '?')}) {how}")
    if not dead:
        return None
    return "vLLM worker process(es) not running: " + "; ".join(dead)


def _proc_state(pid) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError, TypeError):
        return None


def _raise(step: str, exc: BaseException, executor=None):
    health = worker_health(executor) if executor is not None else None
    origin = f"\n{health}" if health else ""
    raise ExtractionError(f"{step} failed: {describe_exception(exc)}{origin}\n[{_context()}]") from exc


def rpc_timeout() -> float:
    """Seconds a shim RPC may take before generate() fails (SPECULATORS_COMPAT_RPC_TIMEOUT, 600)."""
    from ..settings import number

    return number("SPECULATORS_COMPAT_RPC_TIMEOUT")


def _rpc(executor, op, *args):
    try:
        replies = executor.collective_rpc(RPC_NAME, args=(op, *args), timeout=rpc_timeout())
    except Exception as exc:  # noqa: BLE001
        _raise(f"worker RPC {op}", exc, executor)
    return _rpc_values(op, replies)


def _rpc_values(op, replies):
    for rank, reply in enumerate(replies):
        if not reply.get("ok"):
            raise ExtractionError(
                f"worker RPC {op} failed on rank {rank} (pid {reply.get('pid')}): "
                f"{reply.get('type')}: {reply.get('message') or '(no message)'}\n"
                f"worker traceback:\n{reply.get('traceback')}\n[{_context()}]"
            )
    return [r["value"] for r in replies]


def _engine_step(executor, scheduler, so, what: str, clock: dict) -> None:
    """One step as vLLM's EngineCore.step drives it: execute, sample where split, update."""
    try:
        t0 = time.perf_counter()
        output = executor.execute_model(so)
        t1 = time.perf_counter()
        if output is None and callable(getattr(executor, "sample_tokens", None)):
            output = executor.sample_tokens(None)  # 0.11.1+: execute_model defers sampling
        t2 = time.perf_counter()
        scheduler.update_from_output(so, output)
        t3 = time.perf_counter()
    except Exception as exc:  # noqa: BLE001
        _raise(what, exc, executor)
    clock["execute_model"] += t1 - t0
    clock["sample_tokens"] += t2 - t1
    clock["update_from_output"] += t3 - t2


def _tokens_list(token_ids, torch):
    if isinstance(token_ids, torch.Tensor):
        return token_ids.tolist()
    if not token_ids:
        raise ValueError("token_ids cannot be empty")
    return [ids.tolist() if isinstance(ids, torch.Tensor) else list(ids) for ids in token_ids]


def _token_tensors(sequences, torch):
    """Each sequence as an int64 tensor over an ``array('q')`` (zero-copy; ~5x faster than
    ``torch.as_tensor`` on a list), or None where a sequence holds something that is not a
    64-bit integer (``_check_token_ids`` then names it)."""
    from array import array

    try:
        return [torch.frombuffer(array("q", ids), dtype=torch.long) if len(ids) else torch.empty(0, dtype=torch.long) for ids in sequences]
    except (TypeError, OverflowError, ValueError):
        return None


def _check_token_ids(sequences, vocab_size: int, tensors=None) -> None:
    """One-line ValueError for input the engine would fail on later (or, on a GPU, take down
    the worker with a device-side assert): an empty sequence, a non-integer or out-of-vocabulary
    token id. Nothing has been scheduled yet, so the generator stays usable. With ``tensors``
    (``_token_tensors``) the common all-valid case is one vectorised min/max."""
    if tensors is not None and all(len(t) for t in tensors):
        import torch

        low, high = (int(v) for v in torch.cat(tensors).aminmax())
        if low >= 0 and high < vocab_size:
            return
    for i, ids in enumerate(sequences):
        if len(ids) == 0:
            raise ValueError(f"token_ids[{i}] is empty: every sequence needs at least one token")
        try:
            low, high = min(ids), max(ids)
        except TypeError:
            bad = next(t for t in ids if not isinstance(t, Integral))
            raise ValueError(f"token_ids[{i}] holds {bad!r} ({type(bad).__name__}): token ids must be integers") from None
        if not isinstance(low, Integral) or not isinstance(high, Integral):
            bad = low if not isinstance(low, Integral) else high
            raise ValueError(f"token_ids[{i}] holds {bad!r} ({type(bad).__name__}): token ids must be integers")
        if low < 0 or high >= vocab_size:
            pos = ids.index(low if low < 0 else high)
            raise ValueError(
                f"token_ids[{i}][{pos}] = {ids[pos]} is outside the model's vocabulary [0, {vocab_size})"
            )


def generate(self, token_ids):
    """Extract hidden states from the prefill of each sequence (speculators' contract)."""
    import torch

    module = sys.modules[GENERATOR]
    log = module.log
    input_ids_list = _tokens_list(token_ids, torch)
    log.debug(f"Generating hidden states for {len(input_ids_list)} sequences")
    max_len = self.vllm_config.model_config.max_model_len - module.MAX_DECODE_TOKENS
    id_tensors = _token_tensors(input_ids_list, torch)
    _check_token_ids(input_ids_list, self.vllm_config.model_config.get_vocab_size(), id_tensors)
    original_lengths = [len(ids) for ids in input_ids_list]
    input_ids_list = [ids[:max_len] for ids in input_ids_list]
    truncated = [i for i, n in enumerate(original_lengths) if n > max_len]
    if truncated:
        log.warning(f"Truncated {len(truncated)} sequence(s) to max_model_len - 1 = {max_len} tokens: {truncated[:10]}")

    layer_ids = sorted(set(self.layer_ids))
    model_config = self.vllm_config.model_config
    hidden = model_config.get_hidden_size()
    dtype = model_config.dtype
    dtype_name = str(dtype).replace("torch.", "")
    itemsize = torch.empty((), dtype=dtype).element_size()
    call = self._request_counter
    req_ids = [f"req_{call}_{i}" for i in range(len(input_ids_list))]
    lengths = {rid: len(ids) for rid, ids in zip(req_ids, input_ids_list)}

    # Each sequence's [layers, tokens, hidden] block leases a segment of the exchange pool:
    # shared memory mapped (and page-locked on GPUs) once by both sides, written in place by
    # the worker, returned to the pool when the caller drops the result tensors (exchange.py).
    pool = getattr(self, POOL_ATTR, None)
    if pool is None:
        pool = ExchangePool()
        setattr(self, POOL_ATTR, pool)
    timings = {}
    mark = time.perf_counter()
    row_bytes = len(layer_ids) * hidden * itemsize
    placements, new_chunks, _dropped = pool.allocate({rid: lengths[rid] * row_bytes for rid in req_ids})
    try:
        pin = settings.flag("SPECULATORS_COMPAT_PIN")
        _rpc(
            self.executor,
            "begin",
            {c.id: (c.path, c.size) for c in new_chunks},
            sorted(pool.chunks),
            {rid: (placements[rid][0], placements[rid][1], lengths[rid]) for rid in req_ids},
            len(layer_ids),
            hidden,
            dtype_name,
            pin,
        )
    except BaseException:
        pool.release(placements)
        pool.forget(new_chunks)  # a worker may not have mapped them: never place rows there
        raise
    finally:
        pool.unlink(new_chunks)
    timings["begin"] = time.perf_counter() - mark

    handed = set()
    try:
        _add_requests(self, module, req_ids, input_ids_list)
        mark = time.perf_counter()
        depth = pipeline_depth(self.executor)
        timings["driver"] = f"pipelined({depth})" if depth > 1 else "serial"
        if depth > 1:
            computed, iterations = _drive_pipelined(self.executor, self.scheduler, req_ids, timings, depth)
        else:
            computed, iterations = _drive(self.executor, self.scheduler, req_ids, timings)
        timings["steps"] = time.perf_counter() - mark
        mark = time.perf_counter()
        _rpc(self.executor, "finish")
        timings["finish"] = time.perf_counter() - mark
        log.debug(f"Extraction took {iterations} scheduler iterations in {timings['steps']:.3f}s")
        short = [(rid, computed[rid], lengths[rid]) for rid in req_ids if computed[rid] != lengths[rid]]
        if short:
            raise ExtractionError(
                f"{len(short)} sequence(s) not fully computed (request, computed, length): {short[:5]}\n[{_context()}]"
            )
        results = []
        nlayers = len(layer_ids)
        for i, (rid, ids) in enumerate(zip(req_ids, input_ids_list)):
            n = lengths[rid]
            view = pool.lease_view(placements[rid], n * row_bytes)
            handed.add(rid)
            buf = torch.frombuffer(view, dtype=dtype).view(nlayers, n, hidden)
            ids_tensor = id_tensors[i] if id_tensors is not None else torch.as_tensor(ids, dtype=torch.long)
            if ids_tensor.shape[0] != n:  # truncated: a copy, not a view holding the whole prompt
                ids_tensor = ids_tensor[:n].clone()
            results.append(
                {
                    "input_ids": ids_tensor,
                    "hidden_states": [buf[k] for k in range(nlayers)],
                    "loss_mask": None,
                }
            )
    except BaseException:
        pool.release({rid: p for rid, p in placements.items() if rid not in handed})
        raise
    timings["iterations"] = iterations
    setattr(self, TIMINGS_ATTR, timings)
    return results


def _add_requests(self, module, req_ids, input_ids_list) -> None:
    Request = module.Request
    SamplingParams = module.SamplingParams
    # Block hashes serve prefix caching only, which the generator's engine runs without
    # (cache-config-args; speculators 0.4.x turns it off too): hashing every 16-token block of
    # every prompt cost ~10-30 ms per 64k-token call, as much as two engine steps. vLLM's own
    # engine builds no hasher when caching is off either.
    caching = bool(getattr(self.vllm_config.cache_config, "enable_prefix_caching", False))
    block_hasher = getattr(self, "block_hasher", None) if caching else None
    for rid, ids in zip(req_ids, input_ids_list):
        kwargs = dict(
            request_id=rid,
            prompt_token_ids=ids,
            sampling_params=SamplingParams(max_tokens=module.MAX_DECODE_TOKENS, temperature=module.SAMPLING_TEMPERATURE),
            pooling_params=None,
            eos_token_id=self.tokenizer.eos_token_id,
            arrival_time=module.INITIAL_ARRIVAL_TIME,
        )
        if block_hasher is not None:
            kwargs["block_hasher"] = block_hasher
        self.scheduler.add_request(Request(**kwargs))
    self._request_counter += 1


def _placement(so, computed) -> dict:
    """The capture's row placement for one scheduled batch, {req_id: (tokens, computed before)};
    advances ``computed`` (the scheduler advanced its own count when it scheduled)."""
    step = {}
    for rid, n in so.num_scheduled_tokens.items():
        if rid not in computed:
            raise ExtractionError(f"the scheduler scheduled unknown request {rid!r}\n[{_context()}]")
        step[rid] = (n, computed[rid])
        computed[rid] += n
    return step


def _stuck(scheduler) -> ExtractionError:
    return ExtractionError(
        f"the scheduler scheduled nothing with {scheduler.get_num_unfinished_requests()} request(s) "
        f"unfinished (KV cache too small for the longest sequence?)\n[{_context()}]"
    )


def _drive(executor, scheduler, req_ids, clock):
    """Step the engine until every request finished: ({req_id: tokens computed}, steps).
    Adds the seconds spent in each part of a step to ``clock``."""
    computed = dict.fromkeys(req_ids, 0)
    iterations = 0
    for key in ("schedule", "step_rpc", "execute_model", "sample_tokens", "update_from_output"):
        clock.setdefault(key, 0.0)
    while scheduler.has_unfinished_requests():
        t0 = time.perf_counter()
        so = scheduler.schedule()
        clock["schedule"] += time.perf_counter() - t0
        if so.total_num_scheduled_tokens == 0:
            raise _stuck(scheduler)
        iterations += 1
        step = _placement(so, computed)
        t0 = time.perf_counter()
        _rpc(executor, "step", step)
        clock["step_rpc"] += time.perf_counter() - t0
        _engine_step(executor, scheduler, so, f"engine step {iterations}", clock)
    # Deliver the finished request ids to the workers (V2 runners free slots on them).
    so = scheduler.schedule()
    if so.total_num_scheduled_tokens == 0 and getattr(so, "finished_req_ids", None):
        _rpc(executor, "step", {})
        _engine_step(executor, scheduler, so, "engine cleanup step", clock)
    return computed, iterations


def executor_takes_futures(executor_cls) -> bool:
    """True where ``execute_model``, ``sample_tokens`` and ``collective_rpc`` all take
    ``non_block`` (vLLM's FutureWrapper queue: replies are read in submission order)."""
    from ._signatures import accepts

    return all(
        callable(getattr(executor_cls, name, None)) and accepts(getattr(executor_cls, name), "non_block")
        for name in ("execute_model", "sample_tokens", "collective_rpc")
    )


def pipeline_depth(executor) -> int:
    """Batches the driver keeps in flight: 2 where the executor takes futures, else 1;
    ``SPECULATORS_COMPAT_PIPELINE=0`` forces 1."""
    if not settings.flag("SPECULATORS_COMPAT_PIPELINE"):
        return 1
    return 2 if executor_takes_futures(type(executor)) else 1


def _submit(executor, so, step, clock, what):
    """Send one batch without waiting: the capture placement, execute_model, and (for a batch
    with tokens) sample_tokens, each as a future read back in order later."""
    t0 = time.perf_counter()
    try:
        f_step = executor.collective_rpc(RPC_NAME, args=("step", step), timeout=rpc_timeout(), non_block=True)
        f_exec = executor.execute_model(so, non_block=True)
        # An empty batch (it only carries finished ids to the workers) gives its output from
        # execute_model, as in vLLM's EngineCore; a batch with tokens defers it to sample_tokens.
        f_sample = executor.sample_tokens(None, non_block=True) if so.total_num_scheduled_tokens else None
    except Exception as exc:  # noqa: BLE001
        _raise(what, exc, executor)
    clock["submit"] += time.perf_counter() - t0
    return so, f_step, f_exec, f_sample, what


def _complete(executor, scheduler, batch, clock):
    """Wait for the oldest batch in flight and hand its output to the scheduler."""
    so, f_step, f_exec, f_sample, what = batch
    t0 = time.perf_counter()
    try:
        replies = f_step.result()
        output = f_exec.result()
        sampled = f_sample.result() if f_sample is not None else None
    except Exception as exc:  # noqa: BLE001
        _raise(what, exc, executor)
    _rpc_values("step", replies)
    if output is None:
        output = sampled
    if output is None:
        raise ExtractionError(
            f"{what} failed: execute_model and sample_tokens both returned None "
            f"({so.total_num_scheduled_tokens} tokens scheduled)\n[{_context()}]"
        )
    t1 = time.perf_counter()
    try:
        scheduler.update_from_output(so, output)
    except Exception as exc:  # noqa: BLE001
        _raise(what, exc, executor)
    clock["wait"] += t1 - t0
    clock["update_from_output"] += time.perf_counter() - t1


def _drive_pipelined(executor, scheduler, req_ids, clock, depth=2):
    """``_drive`` with up to ``depth`` batches in flight (see the module docstring)."""
    computed = dict.fromkeys(req_ids, 0)
    iterations = 0
    for key in ("schedule", "submit", "wait", "update_from_output"):
        clock.setdefault(key, 0.0)
    inflight: deque = deque()
    while True:
        while len(inflight) < depth and scheduler.has_unfinished_requests():
            t0 = time.perf_counter()
            so = scheduler.schedule()
            clock["schedule"] += time.perf_counter() - t0
            if so.total_num_scheduled_tokens == 0:
                # Nothing left to schedule until a batch in flight returns. Ids finished by an
                # earlier update ride on this output: the workers must see them (V2 runners
                # free request slots on them), so it is sent like vLLM's engine sends it.
                if getattr(so, "finished_req_ids", None):
                    inflight.append(_submit(executor, so, {}, clock, f"engine step {iterations} (finished ids)"))
                break
            iterations += 1
            inflight.append(_submit(executor, so, _placement(so, computed), clock, f"engine step {iterations}"))
        if not inflight:
            if scheduler.has_unfinished_requests():
                raise _stuck(scheduler)
            break
        _complete(executor, scheduler, inflight.popleft(), clock)
    # Deliver the last finished request ids to the workers (V2 runners free slots on them).
    so = scheduler.schedule()
    if so.total_num_scheduled_tokens == 0 and getattr(so, "finished_req_ids", None):
        _complete(executor, scheduler, _submit(executor, so, {}, clock, "engine cleanup step"), clock)
    return computed, iterations


def _replace_generate(wrapped, instance, args, kwargs):
    return generate(instance, *args, **kwargs)


def _probe_generate(current):
    params = parameters(current)
    if params is None or "token_ids" not in params:
        return f"expected VllmHiddenStatesGenerator.generate(self, token_ids); found {current!r}"
    module = sys.modules.get(GENERATOR)
    for name in ("MAX_DECODE_TOKENS", "SAMPLING_TEMPERATURE", "INITIAL_ARRIVAL_TIME", "log", "Request", "SamplingParams"):
        if not hasattr(module, name):
            return f"expected the generator module to define {name}; not found"
    sched = import_attr("vllm.v1.core.sched.scheduler", "Scheduler")
    for name in ("schedule", "update_from_output", "add_request", "has_unfinished_requests", "get_num_unfinished_requests"):
        if not callable(getattr(sched, name, None)):
            return f"expected Scheduler.{name}(); not found"
    executor = import_attr("vllm.v1.executor.multiproc_executor", "MultiprocExecutor")
    for name in ("execute_model", "collective_rpc"):
        if not callable(getattr(executor, name, None)):
            return f"expected MultiprocExecutor.{name}(); not found"
    return None


# -- async-scheduling ---------------------------------------------------------------------
# What vLLM changed: its own engine runs with async scheduling on accelerators (on by default for
# configs that leave it unset, 0.14+): each worker hands sampled tokens to an output thread and
# goes on to prepare the next batch while the device computes (measured on an H200, vLLM 0.24:
# +31% prefill throughput at 1024-token prompts over the same engine without it). The generator's
# hand-built config has it off (``scheduler-config-args`` sets False: it drove one step at a
# time). With the pipelined driver two batches are in flight, so the patch turns the workers'
# async mode on where vLLM's worker process supports it (``WorkerProc.async_output_busy_loop``)
# and the executor takes futures. The CPU platform turns async scheduling off itself (vLLM's
# ``CpuPlatform.check_and_update_config``): the probe reports "not needed" there.
# ``SPECULATORS_COMPAT_ASYNC_SCHEDULING=0`` leaves it off.


def _executor_async_scheduling(wrapped, instance, args, kwargs):
    # scheduler-config-args owns SchedulerConfig.async_scheduling (engine_config.py decides it)
    from .engine_config import settle_async_scheduling

    config = kwargs.get("vllm_config", args[0] if args else None)
    settle_async_scheduling(config, executor_takes_futures(wrapped))
    return wrapped(*args, **kwargs)


def _probe_async_scheduling(current):
    from ..registry import NotNeeded

    real = import_attr("vllm.v1.executor.multiproc_executor", "MultiprocExecutor")
    if not executor_takes_futures(real):
        return (
            "expected MultiprocExecutor.execute_model/sample_tokens/collective_rpc(..., non_block=...); "
            f"found execute_model{parameters(real.execute_model)}"
        )
    worker_proc = import_attr("vllm.v1.executor.multiproc_executor", "WorkerProc")
    if not callable(getattr(worker_proc, "async_output_busy_loop", None)):
        return "expected WorkerProc.async_output_busy_loop (the workers' async output thread); not found"
    fields = getattr(import_attr("vllm.config", "SchedulerConfig"), "__dataclass_fields__", {}) or {}
    if "async_scheduling" not in fields:
        return "expected SchedulerConfig.async_scheduling; not found"
    from .engine_options import _on_cpu

    if _on_cpu():
        return NotNeeded("the CPU platform runs without async scheduling (vLLM turns it off there)")
    return None


PATCHES = [
    wrapper_patch(
        "async-scheduling",
        "execution",
        GENERATOR,
        "MultiprocExecutor",
        _executor_async_scheduling,
        _probe_async_scheduling,
    ),
    wrapper_patch(
        "generate-driver",
        "execution",
        GENERATOR,
        "VllmHiddenStatesGenerator.generate",
        _replace_generate,
        _probe_generate,
    )
]
