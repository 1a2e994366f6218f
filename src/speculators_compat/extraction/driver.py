"""``generate``: speculators' contract, driven the way vLLM's engine drives itself.

Keeps speculators' request ids, truncation, logger and result dicts in input order; hidden states
arrive in shared memory written in place by the workers (``capture``, ``exchange``). A call
returns every sequence's rows for every layer, written in this call, or raises; after any
failure the next call works or says why not (``GeneratorUnusable``). A sample of each call's
rows is self-checked (``selfcheck``); tallies and phase timings are left on the generator.
Details: docs/MODULES.md.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from .. import settings
from ..exchange import ExchangePool
from . import inputs, protocol, selfcheck, steps
from .errors import ExtractionError, GeneratorUnusable, context, describe_exception, fail, worker_health

GENERATOR = "speculators.data_generation.vllm_hidden_states_generator"
POOL_ATTR = "_speculators_compat_pool"
TIMINGS_ATTR = "_speculators_compat_timings"
LOCK_ATTR = "_speculators_compat_lock"
BROKEN_ATTR = "_speculators_compat_unusable"
CHECK_ATTR = "_speculators_compat_self_check"  # the self-check's tally over the generator's calls

_lock_guard = threading.Lock()


def rpc_timeout() -> float:
    """Seconds a shim RPC may take before generate() fails (SPECULATORS_COMPAT_RPC_TIMEOUT)."""
    return settings.number_set("SPECULATORS_COMPAT_RPC_TIMEOUT")


def rpc(executor, op, *args):
    """One shim RPC to every worker; its replies' values (rank order), checked for this RPC."""
    seq = protocol.next_seq()
    try:
        replies = executor.collective_rpc(protocol.RPC_NAME, args=(seq, op, *args), timeout=rpc_timeout())
    except Exception as exc:  # noqa: BLE001
        raise fail(f"worker RPC {op}", exc, executor) from exc
    return protocol.values(op, seq, replies)


def _generator_lock(gen) -> threading.Lock:
    lock = getattr(gen, LOCK_ATTR, None)
    if lock is None:
        with _lock_guard:
            lock = getattr(gen, LOCK_ATTR, None)
            if lock is None:
                lock = threading.Lock()
                setattr(gen, LOCK_ATTR, lock)
    return lock


def generate(self, token_ids):
    """Extract hidden states from the prefill of each sequence (speculators' contract)."""
    with _generator_lock(self):
        broken = getattr(self, BROKEN_ATTR, None)
        if broken:
            raise GeneratorUnusable(
                f"this generator cannot be used any more: {broken}. Create a new VllmHiddenStatesGenerator."
            )
        return _generate(self, token_ids)


def _generate(self, token_ids):
    import torch

    module = sys.modules[GENERATOR]
    log = module.log
    started = time.perf_counter()
    seqs = inputs.sequences(token_ids)
    layer_ids, requested = inputs.check_layer_ids(self.layer_ids)
    log.debug(f"Generating hidden states for {len(seqs)} sequences")
    model_config = self.vllm_config.model_config
    max_len = model_config.max_model_len - module.MAX_DECODE_TOKENS
    id_tensors = inputs.token_tensors(seqs, torch)
    inputs.check_token_ids(seqs, model_config.get_vocab_size(), id_tensors)
    original_lengths = [len(ids) for ids in seqs]
    seqs = [ids[:max_len] for ids in seqs]
    truncated = [i for i, n in enumerate(original_lengths) if n > max_len]
    if truncated:
        log.warning(f"Truncated {len(truncated)} sequence(s) to max_model_len - 1 = {max_len} tokens: {truncated[:10]}")

    hidden = model_config.get_hidden_size()
    dtype = model_config.dtype
    nlayers = len(layer_ids)
    slot = {lid: k for k, lid in enumerate(layer_ids)}
    call = self._request_counter
    self._request_counter += 1  # ids of a failed call are never reused
    req_ids = [f"req_{call}_{i}" for i in range(len(seqs))]
    lengths = {rid: len(ids) for rid, ids in zip(req_ids, seqs)}
    row_bytes = _row_bytes(self)

    check_rows = int(settings.number_set("SPECULATORS_COMPAT_SELF_CHECK_ROWS"))
    checking = check_rows <= 0 or selfcheck.due(getattr(self, CHECK_ATTR, None),
                                                settings.number_set("SPECULATORS_COMPAT_SELF_CHECK_BUDGET"))
    pool = _pool(self)
    timings = {}
    mark = time.perf_counter()
    timings["prepare"] = mark - started
    # one block [tokens, hidden] per sequence and layer (each result tensor owns its storage); a
    # layer's blocks back to back in input order, so a step's rows of consecutive sequences are
    # one range for the workers' copies
    placements, new_chunks, _dropped = pool.allocate_runs(
        [[((rid, k), lengths[rid] * row_bytes) for rid in req_ids] for k in range(nlayers)]
    )
    begin = protocol.Begin(
        call=call,
        caller_pid=os.getpid(),
        new_chunks={c.id: c.ref() for c in new_chunks},
        live_chunks=tuple(sorted(pool.chunks)),
        placements={rid: ([placements[(rid, k)][:2] for k in range(nlayers)], lengths[rid]) for rid in req_ids},
        layers=nlayers,
        hidden=hidden,
        dtype=str(dtype).replace("torch.", ""),
        pin=settings.flag("SPECULATORS_COMPAT_PIN"),
        check_rows=check_rows if checking else 0,
    )
    handed: set = set()
    prebuilt: dict = {}  # {req_id: [tensor per layer slot]}, made while the first batch computes

    def build_states():
        # a tensor per block (~7 us each): 512 of them at batch 128 x 4 layers, off the critical path
        for rid in req_ids:
            n = lengths[rid]
            states = []
            for k in range(nlayers):
                view = pool.lease_view(placements[(rid, k)], n * row_bytes)
                handed.add((rid, k))
                states.append(torch.frombuffer(view, dtype=dtype).view(n, hidden))
            prebuilt[rid] = states

    try:
        rpc(self.executor, protocol.BEGIN, begin)
        timings["begin"] = time.perf_counter() - mark
        mark = time.perf_counter()
        _add_requests(self, module, req_ids, seqs)
        timings["add_requests"] = time.perf_counter() - mark
        mark = time.perf_counter()
        depth = steps.pipeline_depth(self.executor)
        timings["driver"] = f"pipelined({depth})" if depth > 1 else "serial"
        computed, iterations = steps.drive(self.executor, self.scheduler, req_ids, timings, depth, rpc_timeout(),
                                           idle=build_states)
        timings["steps"] = time.perf_counter() - mark
        mark = time.perf_counter()
        finished = [r for r in rpc(self.executor, protocol.FINISH) if r]
        counts = _merge_counts([r["written"] for r in finished])
        timings["finish"] = time.perf_counter() - mark
        for part in ("gather", "device", "norm", "transfer"):  # the self-check's share of finish (slowest rank)
            timings[f"check_{part}"] = max((r["check"].get("cost_s", {}).get(part, 0.0) for r in finished
                                            if r.get("check")), default=0.0)
        log.debug(f"Extraction took {iterations} scheduler iterations in {timings['steps']:.3f}s")
        mark = time.perf_counter()
        _verify(req_ids, lengths, computed, counts, nlayers)
        checked = None
        if checking:  # else a call the budget leaves out (its workers sampled nothing)
            checked = selfcheck.judge([r["check"] for r in finished], dict(zip(req_ids, seqs)), layer_ids)
        timings["judge"] = time.perf_counter() - mark
        mark = time.perf_counter()
        if not prebuilt:
            build_states()
        results = []
        for i, rid in enumerate(req_ids):
            n = lengths[rid]
            states = prebuilt.pop(rid)
            if len(requested) != nlayers:  # a repeated id: its layer's tensor again
                states = [states[slot[lid]] for lid in requested]
            ids_tensor = id_tensors[i] if id_tensors is not None else torch.as_tensor(seqs[i], dtype=torch.long)
            if ids_tensor.shape[0] != n:  # truncated: a copy, not a view holding the whole prompt
                ids_tensor = ids_tensor[:n].clone()
            results.append({"input_ids": ids_tensor, "hidden_states": states, "loss_mask": None})
    except BaseException as exc:
        unhanded = {key: p for key, p in placements.items() if key not in handed}
        _recover(self, req_ids, exc, pool, unhanded, new_chunks)
        prebuilt.clear()  # their blocks return to the pool as these tensors go (after the fence above)
        raise
    timings["results"] = time.perf_counter() - mark
    timings["iterations"] = iterations
    setattr(self, TIMINGS_ATTR, timings)
    check_s = sum(timings[f"check_{part}"] for part in ("gather", "device", "transfer")) + timings["judge"]
    _tally(self, checked, time.perf_counter() - started, check_s)
    return results


def reserve(self, nbytes: int) -> tuple[int, float]:
    """Grow the generator's exchange to ``nbytes`` and map it in the workers before the caller's
    loop, not inside its first calls: (bytes made, seconds). Memory that cannot be had is left to
    the calls (ExchangeError); after any other failure the next call works or says why not."""
    with _generator_lock(self):
        if getattr(self, BROKEN_ATTR, None):
            return 0, 0.0  # its next call says why
        pool = _pool(self)
        started = time.perf_counter()
        new: list = []
        try:
            new = pool.reserve(nbytes)
            if new:
                begin = protocol.Begin(call=-1, caller_pid=os.getpid(), new_chunks={c.id: c.ref() for c in new},
                                       live_chunks=tuple(sorted(pool.chunks)),
                                       pin=settings.flag("SPECULATORS_COMPAT_PIN"))
                rpc(self.executor, protocol.BEGIN, begin)  # maps (and page-locks) the chunks; no placements
                rpc(self.executor, protocol.ABORT)
        except BaseException as exc:
            if new:
                _recover(self, [], exc, pool, {}, new)
                pool.stats["chunks_reserved"] -= len(new)
                pool.stats["bytes_reserved"] -= sum(c.size for c in new)
            raise
        return sum(c.size for c in new), time.perf_counter() - started


def _pool(self) -> ExchangePool:
    """The generator's exchange pool, made at its first use (a call or ``reserve``)."""
    pool = getattr(self, POOL_ATTR, None)
    if pool is None:
        pool = ExchangePool()
        setattr(self, POOL_ATTR, pool)
    return pool


def _row_bytes(self) -> int:
    """Exchange bytes of one token's row of one captured layer."""
    import torch

    model_config = self.vllm_config.model_config
    return model_config.get_hidden_size() * torch.empty((), dtype=model_config.dtype).element_size()


def call_bytes(self, tokens: int) -> int:
    """Exchange bytes of one call of ``tokens`` tokens: every captured layer's rows."""
    return tokens * len(inputs.check_layer_ids(self.layer_ids)[0]) * _row_bytes(self)


def _tally(self, checked: dict | None, call_s: float, check_s: float) -> None:
    """Add one call to the generator's self-check tally (``CHECK_ATTR``): every call's time, and
    the checked calls' results and timed work (what ``selfcheck.due`` weighs)."""
    tally = getattr(self, CHECK_ATTR, None) or {"calls": 0, "checked_calls": 0, "call_s": 0.0, "check_s": 0.0}
    tally["calls"] += 1
    tally["call_s"] += call_s
    if checked is None:
        setattr(self, CHECK_ATTR, tally)
        return
    if checked.get("rows"):  # a call with the check off (ROWS=0) is not a checked call
        tally["checked_calls"] += 1
        tally["check_s"] += check_s
    for key, value in checked.items():
        if key == "final_max_rel_error":
            tally[key] = max(tally.get(key, 0.0), value)
        elif key == "not_covered":
            tally[key] = sorted(set(tally.get(key, [])) | set(value))
        else:
            tally[key] = tally.get(key, 0) + value
    setattr(self, CHECK_ATTR, tally)


def _merge_counts(per_rank) -> dict:
    """{req_id: [rows written per layer]} summed over the capturing ranks (one per stage)."""
    merged: dict = {}
    for counts in per_rank:
        if not counts:
            continue
        for rid, rows in counts.items():
            have = merged.setdefault(rid, [0] * len(rows))
            for k, n in enumerate(rows):
                have[k] += n
    return merged


def _verify(req_ids, lengths, computed, counts, nlayers) -> None:
    short = [(rid, computed[rid], lengths[rid]) for rid in req_ids if computed[rid] != lengths[rid]]
    if short:
        raise ExtractionError(
            f"{len(short)} sequence(s) not fully computed (request, computed, length): {short[:5]}\n[{context()}]"
        )
    wrong = [
        (rid, k, counts.get(rid, [0] * nlayers)[k], lengths[rid])
        for rid in req_ids
        for k in range(nlayers)
        if counts.get(rid, [0] * nlayers)[k] != lengths[rid]
    ]
    if wrong:
        raise ExtractionError(
            f"{len(wrong)} (sequence, layer) block(s) not written in full by the workers in this call "
            f"(request, layer slot, rows written, length): {wrong[:5]}\n[{context()}]"
        )


def _recover(self, req_ids, exc, pool, unhanded, new_chunks) -> None:
    """After a failed call: re-synchronise the workers' replies, abort the call's requests and
    free their memory, so the next call works; else mark the generator unusable."""
    executor, scheduler = self.executor, self.scheduler
    reason = describe_exception(exc).splitlines()[0]
    health = worker_health(executor)
    if health:
        setattr(self, BROKEN_ATTR, f"an earlier call failed ({reason}); {health}")
        return
    timeout = rpc_timeout()
    try:
        protocol.fence(executor, timeout)
        if req_ids:
            _abort_requests(scheduler, req_ids)
            steps.deliver_finished(executor, scheduler, {}, timeout, steps.pipeline_depth(executor) > 1)
        rpc(executor, protocol.ABORT)
    except BaseException as again:  # noqa: BLE001
        setattr(
            self,
            BROKEN_ATTR,
            f"an earlier call failed ({reason}) and the engine could not be brought back "
            f"({describe_exception(again).splitlines()[0]})",
        )
        return
    # the workers hold no placement into these segments any more: they can be leased again
    pool.release(unhanded)
    pool.forget(new_chunks)


def _abort_requests(scheduler, req_ids) -> None:
    from vllm.v1.request import RequestStatus

    live = [rid for rid in req_ids if rid in getattr(scheduler, "requests", {})]
    if live:
        scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)


def _add_requests(self, module, req_ids, seqs) -> None:
    Request = module.Request
    SamplingParams = module.SamplingParams
    # Block hashes serve prefix caching only, which the generator's engine runs without
    # (cache-config-args; speculators 0.4.x turns it off too): hashing every 16-token block of
    # every prompt cost ~10-30 ms per 64k-token call. vLLM's engine builds no hasher then either.
    caching = bool(getattr(self.vllm_config.cache_config, "enable_prefix_caching", False))
    block_hasher = getattr(self, "block_hasher", None) if caching else None
    for rid, ids in zip(req_ids, seqs):
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


def describe(generator) -> list:
    """Each worker's own report (runner, layers, async scheduling, patches applied there)."""
    return rpc(generator.executor, protocol.DESCRIBE)
