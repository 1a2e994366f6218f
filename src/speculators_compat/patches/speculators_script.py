"""speculators' own ``scripts/data_generation_offline.py`` under ``speculators-compat run``.

- ``script-tp-default``: ``--tensor-parallel-size`` defaults to the accelerator count, 0 on a CPU: 1.
- ``device-name-no-accelerator``: ``save_config`` asks a CUDA torch for a device name with no GPU.
- ``generator-del-partial``: ``__del__`` at interpreter exit prints an ``AttributeError``: dropped.
- ``script-resumable-output`` (armed by ``script-main-ready``): the script's save loop, replaced by
  crash-consistent, resumable output (``output.py``), its self-check and opt-in FP8 storage
  (``storage.py``), keeping the script's contract. Versions: compat_matrix.yaml.
Details: docs/MODULES.md.
"""

from __future__ import annotations

import inspect
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

from ..registry import MISSING, Call, NotNeeded, Patch, wrapper_patch
from ._signatures import GENERATOR, calls_problem, import_attr, require_params

CONFIG_GENERATOR = "speculators.data_generation.config_generator"
PREPROCESSING = "speculators.data_generation.preprocessing"
SCRIPT_FUNCTION = "generate_and_save_hidden_states"
_log = logging.getLogger("speculators_compat")


ACCELERATOR_CALLS = (Call("torch.accelerator", "device_count"),)  # script-tp-default, device-name-no-accelerator


def _no_accelerator() -> bool:
    import torch

    return torch.accelerator.device_count() == 0


def _tp_fixed(args: tuple, kwargs: dict, signature: inspect.Signature) -> tuple[tuple, dict] | None:
    """The constructor arguments with tensor_parallel_size=1, or None when nothing is to fix."""
    try:
        bound = signature.bind(None, *args, **kwargs)
    except TypeError:
        return None  # speculators reports its own error
    if bound.arguments.get("tensor_parallel_size") != 0 or not _no_accelerator():
        return None
    bound.arguments["tensor_parallel_size"] = 1
    return tuple(bound.args[1:]), dict(bound.kwargs)


_fixing_subclasses: dict[type, type] = {}


def _fixing_subclass(cls: type, signature: inspect.Signature) -> type:
    sub = _fixing_subclasses.get(cls)
    if sub is None:

        def __init__(self, *args, **kwargs):
            fixed = _tp_fixed(args, kwargs, signature)
            if fixed is not None:
                _log.warning(
                    "speculators_compat: tensor_parallel_size=0 (speculators' script default "
                    "torch.accelerator.device_count() with no accelerator) -> 1"
                )
                args, kwargs = fixed
            super(sub, self).__init__(*args, **kwargs)

        sub = type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
        _fixing_subclasses[cls] = sub
    return sub


def _build_tp_default(current):
    base = import_attr(GENERATOR, "VllmHiddenStatesGenerator")
    signature = inspect.signature(base.__init__)

    def __new__(cls, *args, **kwargs):
        if cls not in _fixing_subclasses.values() and _tp_fixed(args, kwargs, signature) is not None:
            cls = _fixing_subclass(cls, signature)
        return object.__new__(cls)

    return staticmethod(__new__)


def _probe_tp_default(current):
    cls = import_attr(GENERATOR, "VllmHiddenStatesGenerator")
    if not isinstance(cls, type):
        return f"expected {GENERATOR}:VllmHiddenStatesGenerator to be a class; found {cls!r}"
    own = vars(cls).get("__new__")
    if own is not None:
        return f"expected VllmHiddenStatesGenerator without a __new__ of its own; found {own!r}"
    problem = require_params(cls.__init__, ("self", "model_path", "tensor_parallel_size"),
                             "VllmHiddenStatesGenerator.__init__")
    if problem:
        return problem
    try:
        inspect.signature(cls.__init__).bind(None, "model", tensor_parallel_size=1)
    except TypeError as exc:
        return f"expected VllmHiddenStatesGenerator(model_path, tensor_parallel_size=1) to bind; {exc}"
    return calls_problem(ACCELERATOR_CALLS)


def _device_name(wrapped, instance, args, kwargs):
    if _no_accelerator():
        return "NO ACCELERATOR"  # speculators' own answer when torch names no accelerator
    return wrapped(*args, **kwargs)


def _probe_device_name(current):
    if current is MISSING or not callable(current):
        return f"expected {CONFIG_GENERATOR}.get_device_name (speculators.utils.util); found {current!r}"
    problem = calls_problem(ACCELERATOR_CALLS)
    if problem:
        return problem
    try:
        inspect.signature(current).bind(0)
    except (TypeError, ValueError) as exc:
        return f"expected get_device_name(idx) to bind get_device_name(0); {exc}"
    try:
        gpu_info = import_attr(CONFIG_GENERATOR, "_get_gpu_info")
    except (ImportError, AttributeError):
        return f"expected {CONFIG_GENERATOR}._get_gpu_info (its caller); not found"
    source = inspect.getsource(gpu_info)
    if "get_device_name(" not in source or "NO ACCELERATOR" not in source:
        return "expected _get_gpu_info to call get_device_name and treat 'NO ACCELERATOR'; it does not"
    return None


def _del_quiet(wrapped, instance, args, kwargs):
    try:
        return wrapped(*args, **kwargs)
    except AttributeError:
        return None  # a half-built or half-torn-down generator at exit: nothing left to shut down


def _probe_del(current):
    if current is MISSING or not callable(current):
        return f"expected VllmHiddenStatesGenerator.__del__; found {current!r}"
    try:
        source = inspect.getsource(getattr(current, "__wrapped__", current))
    except (OSError, TypeError):
        return "expected VllmHiddenStatesGenerator.__del__ with readable source; unreadable"
    if "executor" not in source or "shutdown" not in source:
        return "expected VllmHiddenStatesGenerator.__del__ to shut the executor down; it does not"
    return None


# -- script-resumable-output ----------------------------------------------------------------

# what the replaced function reads of the script's arguments (its own code: checked by the probe)
_ARGS = ("output_dir", "target_model_path", "layer_ids", "seq_length", "gpu_memory_utilization",
         "tensor_parallel_size", "batch_size", "start_idx")
_GENERATOR_KWARGS = ("model_path", "layer_ids", "max_model_len", "gpu_memory_utilization", "tensor_parallel_size")


def _probe_script(current):
    if current is MISSING:
        return NotNeeded("__main__ defines no generate_and_save_hidden_states (not speculators' "
                         "data_generation_offline.py, or its main() has not started)")
    g = getattr(current, "__globals__", None)
    code = getattr(current, "__code__", None)
    if g is None or code is None or g.get("VllmHiddenStatesGenerator") is not import_attr(GENERATOR, "VllmHiddenStatesGenerator"):
        return NotNeeded("__main__.generate_and_save_hidden_states is not speculators' script's (it does not "
                         "use speculators' VllmHiddenStatesGenerator)")
    problem = require_params(current, ("args", "dataset"), "generate_and_save_hidden_states")
    if problem:
        return problem
    missing = [n for n in ("find_last_checkpoint", "save_sample_to_disk", "save_config", "generate", *_ARGS)
               if n not in code.co_names]
    if missing:
        return ("expected speculators' generate_and_save_hidden_states to call find_last_checkpoint, "
                f"save_sample_to_disk, save_config and generator.generate and read args {', '.join(_ARGS)}; "
                f"found none of {', '.join(missing)}")
    save_config = g.get("save_config")
    if not callable(save_config):
        return f"expected the script's save_config(args, generator, num_samples, output_dir); found {save_config!r}"
    try:
        inspect.signature(save_config).bind(None, None, 0, "dir")
    except TypeError as exc:
        return f"expected save_config(args, generator, num_samples, output_dir) to bind; {exc}"
    return None


def _write_lengths(folder: Path, manifest, fsync: bool) -> None:
    from .. import output

    output.atomic_write_bytes(folder / output.LENGTHS, json.dumps(manifest.lengths(), indent=2).encode(), fsync)


def _data_config(script: dict, args, generator, num_samples: int, folder: Path) -> dict:
    """The script's own save_config, run into a private folder; its data_config.json as a dict."""
    tmp = Path(tempfile.mkdtemp(prefix=".speculators_compat.config.", dir=folder))
    try:
        script["save_config"](args, generator, num_samples, str(tmp))
        return json.loads((tmp / "data_config.json").read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _resumable_run(script: dict, writes_lengths: bool, args, dataset) -> int:
    from .. import get_registry, output, settings, storage
    from ..extraction.driver import POOL_ATTR

    log = script.get("log") or _log
    folder = Path(args.output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        output.lock_folder(folder)
    except output.OutputRefused as exc:
        raise SystemExit(f"speculators-compat: {exc}") from None
    fsync = settings.flag("SPECULATORS_COMPAT_OUTPUT_FSYNC")
    mode = (settings.text("SPECULATORS_COMPAT_OUTPUT_RESUME") or "auto").lower()
    if mode not in ("auto", "restart"):
        raise SystemExit(f"speculators-compat: SPECULATORS_COMPAT_OUTPUT_RESUME={mode!r}: expected auto or restart")
    limit = int(settings.number_set("SPECULATORS_COMPAT_SAVE_BUFFER_MB") * 2**20)
    try:
        store = storage.chosen()
    except settings.SettingError as exc:
        raise SystemExit(f"speculators-compat: {exc}") from None
    n, first, bs = len(dataset), int(args.start_idx), int(args.batch_size)
    run = {
        "format": output.FORMAT, "model": str(args.target_model_path),
        "model_config_sha256": output.model_config_sha256(str(args.target_model_path)),
        "train_data_path": str(getattr(args, "train_data_path", None)), "seq_length": args.seq_length,
        "max_samples": getattr(args, "max_samples", None), "seed": getattr(args, "seed", None),
        "assistant_pattern": getattr(args, "assistant_pattern", None),
        "turn_dropout": getattr(args, "turn_dropout", None), "layer_ids": args.layer_ids, "start_idx": first,
        "num_samples": n, "dataset_probe": output.dataset_probe(lambda i: dataset[i]["input_ids"], n),
        "writes_sample_lengths": writes_lengths, "batch_size": bs,
        "versions": get_registry().version_strings(),
    }
    if store:
        run["storage"] = store  # a folder is extended only in the format it holds
    manifest = output.Manifest.read(folder)
    present = output.data_files(folder)
    if mode == "restart":
        for p in [*present.values(), *(folder / f for f in (output.LENGTHS, output.CONFIG, output.MANIFEST))]:
            p.unlink(missing_ok=True)
        manifest, present = output.Manifest(folder), {}
        log.info(f"SPECULATORS_COMPAT_OUTPUT_RESUME=restart: removed the data files of {folder}")
    for p in folder.glob(output._TMP_PREFIX + "*"):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    if manifest.run is None:
        if present:
            raise SystemExit(
                f"speculators-compat: {folder} holds {len(present)} data_*.pt file(s) but no {output.MANIFEST}: "
                "they were not written by this crash-consistent output and cannot be trusted; use a new "
                "--output-dir, or SPECULATORS_COMPAT_OUTPUT_RESUME=restart to delete them and start over")
        manifest.start(run, fsync)
    else:
        problem = output.identity_mismatch(manifest.run, run)
        if problem:
            raise SystemExit(
                f"speculators-compat: {folder} holds data of another run ({problem}); use a new --output-dir, "
                "or SPECULATORS_COMPAT_OUTPUT_RESUME=restart to delete it and start over")
        if manifest.run.get("versions") != run["versions"]:
            log.info(f"speculators_compat: resuming data made with {manifest.run.get('versions')} "
                     f"under {run['versions']}")
        manifest.reopen(fsync)
    done = {i for i, rec in manifest.files.items()
            if first <= i < first + n and i in present and present[i].stat().st_size == rec["bytes"]}
    batches = [s for s in range(0, n, bs) if any(first + i not in done for i in range(s, min(s + bs, n)))]
    if not batches:
        if writes_lengths:
            _write_lengths(folder, manifest, fsync)
        if not (folder / output.CONFIG).exists() and manifest.data_config is not None:
            output.atomic_write_bytes(folder / output.CONFIG, json.dumps(manifest.data_config, indent=2).encode(), fsync)
        log.info("All samples already processed!")
        return 0
    if done:
        getattr(log, "subsection", log.info)(f"Resuming: {len(done)} of {n} files complete ({output.MANIFEST}); "
                       f"{len(batches)} batch(es) of {bs} to run")
    last = [time.monotonic()]

    def saved() -> None:  # sample_lengths.json: a consistent subset while running, at most every 30 s
        if writes_lengths and time.monotonic() - last[0] > 30:
            last[0] = time.monotonic()
            _write_lengths(folder, manifest, fsync)

    def encode(index: int, obj: dict) -> tuple[dict, dict]:  # on the save threads
        coded = storage.encode(obj)
        return coded, ({"fp8_rel_error": storage.measured(obj, coded)} if (index - first) % FP8_MEASURE_EVERY == 0
                       else {})

    workers = int(script.get("MAX_IO_WORKERS", 4))  # FP8: half the bytes to hash, encoding's copies on each thread
    built: list = []  # the generator, once built: its exchange pool is what the saver process reads
    # made before the engine loads, so a saver process (SPECULATORS_COMPAT_SAVE_PROCESS) has imported torch by the first batch
    queue = output.SaveQueue(manifest, workers if store else output.save_workers(workers), limit, fsync, saved,
                             encode if store else None,
                             shared=(lambda: getattr(built[0], POOL_ATTR, None)) if settings.flag("SPECULATORS_COMPAT_SAVE_PROCESS") else None)
    try:
        getattr(log, "subsection", log.info)("Initializing vLLM hidden states generator")  # a plain logger has no subsection
        generator = script["VllmHiddenStatesGenerator"](
            model_path=args.target_model_path, layer_ids=args.layer_ids, max_model_len=args.seq_length,
            gpu_memory_utilization=args.gpu_memory_utilization, tensor_parallel_size=args.tensor_parallel_size)
        built.append(generator)
        return _generate_and_save(script, args, dataset, log, folder, manifest, queue, generator, store, limit,
                                  fsync, writes_lengths, n, first, bs, done, batches)
    finally:
        queue.drain()  # a generate error is raised after the saves already begun are complete


def _generate_and_save(script, args, dataset, log, folder, manifest, queue, generator, store, limit, fsync,
                       writes_lengths, n, first, bs, done, batches) -> int:
    from .. import output, settings, storage
    from ..extraction.driver import CHECK_ATTR, POOL_ATTR, TIMINGS_ATTR
    from ..extraction.selfcheck import SelfCheckFailed

    layer_ids = [int(x) for x in generator.layer_ids]
    config = _data_config(script, args, generator, n, folder)
    if store:
        config[storage.FORMAT_KEY] = {"format": store, "hidden_states": storage.LAYOUT}
    recorded = (manifest.data_config or {}).get("hidden_states", {}).get("layer_ids")
    if recorded is not None and recorded != config.get("hidden_states", {}).get("layer_ids"):
        raise SystemExit(f"speculators-compat: {folder} holds data of layers {recorded}; this run captures "
                         f"{layer_ids}; use a new --output-dir")
    manifest.append({"data_config": config})
    canary = _Canary(folder, manifest, first, dataset, int(settings.number_set("SPECULATORS_COMPAT_SELF_CHECK_EVERY")),
                     first in done)
    _reserve_exchange(generator, dataset, args, log, bs, n, batches, canary, limit)
    log.info(f"Processing {sum(first + i not in done for i in range(n))}/{n} samples")
    progress = script.get("tqdm", lambda it, **kw: it)(batches, desc="Generating hidden states", total=len(batches))
    generate_s: list[float] = []  # per batch, for the timing line at the end
    phases: dict[str, float] = {}  # inside generate(), summed over the batches
    loop_start = time.perf_counter()
    try:
        for s in progress:
            batch = dataset[s:min(s + bs, n)]
            extra = canary.joins(s // bs)  # by batch number alone: a resumed batch is the batch it was
            try:
                t = time.perf_counter()
                results = generator.generate(list(batch["input_ids"]) + extra)
                generate_s.append(time.perf_counter() - t)
                _add_phases(phases, getattr(generator, TIMINGS_ATTR, None) or {})
            except SelfCheckFailed as exc:
                manifest.append({"self_check": {"kind": "engine", "batch": s // bs, "sample": first + s,
                                                "verdict": "fail", "problem": str(exc).splitlines()[0]}})
                raise
            results, again = (results[:-1], results[-1]) if extra else (results, None)
            for j, result in enumerate(results):
                index = first + s + j
                input_len = len(result["input_ids"])
                obj = {"input_ids": result["input_ids"],
                       "hidden_states": [h.contiguous() for h in result["hidden_states"]],
                       "loss_mask": batch["loss_mask"][j][:input_len]}
                canary.first_capture(index, obj)
                if index not in done:  # else computed again only to keep the batch as it was
                    queue.submit(index, output.data_name(index), obj, input_len, layer_ids)
            if again is not None:
                canary.check(s // bs, again)
    finally:
        loop_s = time.perf_counter() - loop_start
        log.info("Waiting for remaining file saves to complete...")
        queue.drain()  # a generate error is raised after the saves already begun are complete (drain again: no-op)
    if generate_s:
        log.info(f"speculators_compat timing: loop {loop_s:.3f} s over {len(generate_s)} batch(es): generate "
                 f"{sum(generate_s):.3f} s (first batch {generate_s[0]:.3f} s), waiting for saves "
                 f"{queue.blocked_s:.3f} s, the rest {loop_s - sum(generate_s) - queue.blocked_s:.3f} s; "
                 f"inside generate: {_phase_text(phases, sum(generate_s))}; "
                 f"{_pool_text(getattr(generator, POOL_ATTR, None))}")
    if canary.checks:
        log.info(f"speculators_compat self-check: sample {first} captured again in {canary.checks} batch(es), "
                 f"largest row error {canary.worst:.3g} (limit {output.CANARY_TOLERANCE})")
    engine = getattr(generator, CHECK_ATTR, None)
    if engine:
        manifest.append({"self_check": dict(engine, kind="engine", batch="all", verdict="pass")})
        checked = engine.get("checked_calls", engine["calls"])
        log.info(f"speculators_compat self-check: {engine.get('rows', 0)} sampled rows in {checked} of "
                 f"{engine['calls']} call(s) (SPECULATORS_COMPAT_SELF_CHECK_BUDGET) match the engine's own "
                 "token ids, positions and layer outputs"
                 + (f"; final norm largest error {engine['final_max_rel_error']:.3g}" if engine.get("final_rows") else "")
                 + (f"; not covered: {', '.join(engine['not_covered'])}" if engine.get("not_covered") else ""))
    worst = output.fp8_worst(manifest.files.values()) if store else None
    if worst:
        log.info(f"speculators_compat: data stored as {store}; largest row error vs the captured rows, per layer "
                 f"{layer_ids}: {', '.join(f'{x:.3g}' for x in worst)} (every {FP8_MEASURE_EVERY}th file measured)")
    if writes_lengths:
        _write_lengths(folder, manifest, fsync)
    output.atomic_write_bytes(folder / output.CONFIG, json.dumps(config, indent=2).encode(), fsync)
    by_saver = f"{queue.saved_by_saver} written by the saver process; " if queue.uses_saver else ""
    left = queue.at_drain or (0, 0, 0.0)
    log.info(f"Saved {queue.saved} new data points to {args.output_dir} ({by_saver}largest save backlog "
             f"{queue.peak_inflight / 2**20:.0f} MiB of {limit / 2**20:.0f} MiB; {left[0] / 2**20:.0f} MiB in "
             f"{left[1]} file(s) left at the loop's end, saved in {left[2]:.3f} s)")
    return queue.saved


FP8_MEASURE_EVERY = 16  # with FP8 storage, every 16th file's row errors go into its manifest line


def _add_phases(total: dict, timings: dict) -> None:
    for key in ("begin", "steps", "finish"):
        if isinstance(timings.get(key), float):
            total[key] = total.get(key, 0.0) + timings[key]


def _phase_text(phases: dict, generate_s: float) -> str:
    parts = [f"{k} {phases[k]:.3f} s" for k in ("begin", "steps", "finish") if k in phases]
    return ", ".join([*parts, f"the rest {generate_s - sum(phases.values()):.3f} s"])


def _pool_text(pool) -> str:
    if pool is None:
        return "exchange: none"
    st = pool.stats
    made, made_bytes = st["chunks_created"] - st["chunks_reserved"], st["bytes_created"] - st["bytes_reserved"]
    return (f"exchange: {made} chunk(s) made ({made_bytes / 2**20:.0f} MiB), {st['chunks_dropped']} dropped, "
            f"over {st['calls']} call(s); {st['bytes_reserved'] / 2**20:.0f} MiB reserved before the loop")


RESERVE_CALLS = 4  # one call computing, one of room, two held by the saves (the pool grew to 4.2 x a call at 384 samples, H100)
RESERVE_LOOKAHEAD = 8  # batches whose token counts size the reserve


def _reserve_exchange(generator, dataset, args, log, bs: int, n: int, batches: list, canary, limit: int) -> None:
    """The exchange grown and mapped in the workers after the engine starts, before the loop
    (``driver.reserve``): 4 calls of the largest of the first batches to run, at most 2 calls plus
    the save buffer (what the loop itself can grow to); 2 calls where that cannot be had. Memory
    that cannot be had at all is left to the loop, as before; a warning says so."""
    from .. import get_registry
    from ..exchange import ExchangeError
    from ..extraction import driver

    if not get_registry().is_applied("generate-driver") or not batches:
        return  # speculators' own generate: no exchange
    try:
        cap = int(args.seq_length)
        tokens = max(sum(min(len(ids), cap) for ids in dataset[s:min(s + bs, n)]["input_ids"])
                     for s in batches[:RESERVE_LOOKAHEAD])
        tokens += min(len(canary.ids), cap) if canary.ids is not None else 0
        call = driver.call_bytes(generator, tokens)
        for calls in (RESERVE_CALLS, 2):
            try:
                made, seconds = driver.reserve(generator, min(calls * call, 2 * call + limit))
                break
            except ExchangeError:
                if calls == 2:
                    raise
    except Exception as exc:  # noqa: BLE001 - the loop grows the exchange as it needs (or says why it cannot)
        log.warning(f"speculators_compat: exchange not reserved before the loop "
                    f"({(str(exc) or type(exc).__name__).splitlines()[0]}); the first batches make it")
        return
    if made:
        log.info(f"speculators_compat: exchange reserved before the loop: {made / 2**20:.0f} MiB "
                 f"({calls} x {tokens} tokens) in {seconds:.3f} s")


class _Canary:
    """The run's self-check: sample 0 of the dataset joins every ``every``-th batch (by number)
    once more; its rows there must match its first capture (``output.canary_error``). A mismatch
    is recorded in the manifest and stops the run."""

    def __init__(self, folder: Path, manifest, first: int, dataset, every: int, saved: bool):
        self.folder, self.manifest, self.first, self.every = folder, manifest, first, max(0, every)
        self.ids = list(dataset[0]["input_ids"]) if self.every else None
        self.reference: dict | None = None
        self.saved = saved
        self.checks, self.worst = 0, 0.0
        self.as_saved = False  # the reference was read back from an FP8 file: compare FP8-rounded rows

    def joins(self, batch_number: int) -> list:
        return [self.ids] if self.every and batch_number % self.every == self.every - 1 else []

    def first_capture(self, index: int, obj: dict) -> None:
        if index == self.first and self.reference is None:
            self.reference = obj

    def check(self, batch_number: int, again: dict) -> None:
        from .. import output, storage

        if self.reference is None and self.saved:
            import torch

            self.reference = torch.load(self.folder / output.data_name(self.first), weights_only=True)
        if self.reference is not None and storage.FP8_KEY in self.reference:  # saved as FP8: compare as saved
            self.reference, self.as_saved = storage.decode(self.reference), True
        if self.as_saved:
            again = storage.decode(storage.encode(again))
        if self.reference is None:
            raise RuntimeError(f"speculators-compat self-check: sample {self.first}'s first capture is neither "
                               "in this run nor saved")
        err, problem = output.canary_error(self.reference, again)
        self.checks, self.worst = self.checks + 1, max(self.worst, err)
        self.manifest.append({"self_check": {"batch": batch_number, "sample": self.first, "max_rel_error": err,
                                             "verdict": "fail" if problem else "pass", "problem": problem}})
        if problem:
            raise RuntimeError(
                f"speculators-compat self-check failed: sample {self.first}, captured again in batch "
                f"{batch_number}: {problem}; this run's data cannot be trusted (recorded in {output.MANIFEST})")


def _build_resumable(current):
    script = current.__globals__
    writes_lengths = "sample_lengths.json" in current.__code__.co_consts  # speculators 0.4.x writes it

    def generate_and_save_hidden_states(args, dataset):
        return _resumable_run(script, writes_lengths, args, dataset)

    generate_and_save_hidden_states.__wrapped__ = current
    generate_and_save_hidden_states.__doc__ = current.__doc__
    return generate_and_save_hidden_states


def _script_ready(wrapped, instance, args, kwargs):
    from .. import get_registry

    get_registry().retry("script-resumable-output")  # the script's main() is running: its functions exist
    return wrapped(*args, **kwargs)


def _probe_preprocessing(current):
    if current is MISSING or not callable(current):
        return f"expected {PREPROCESSING}.load_and_preprocess_dataset; found {current!r}"
    return None


PATCHES = [
    wrapper_patch(
        "generator-del-partial",
        "speculators-script",
        GENERATOR,
        "VllmHiddenStatesGenerator.__del__",
        _del_quiet,
        _probe_del,
    ),
    Patch(
        id="script-tp-default",
        family="speculators-script",
        hook_module=GENERATOR,
        attribute="VllmHiddenStatesGenerator.__new__",
        build=_build_tp_default,
        probe=_probe_tp_default,
        calls=ACCELERATOR_CALLS,
    ),
    wrapper_patch(
        "device-name-no-accelerator",
        "speculators-script",
        CONFIG_GENERATOR,
        "get_device_name",
        _device_name,
        _probe_device_name,
        calls=ACCELERATOR_CALLS,
    ),
    wrapper_patch(
        "script-main-ready",
        "speculators-script",
        PREPROCESSING,
        "load_and_preprocess_dataset",
        _script_ready,
        _probe_preprocessing,
    ),
    Patch(
        id="script-resumable-output",
        family="speculators-script",
        hook_module=PREPROCESSING,
        owner_module="__main__",
        attribute=SCRIPT_FUNCTION,
        build=_build_resumable,
        probe=_probe_script,
        calls=(Call(GENERATOR, "VllmHiddenStatesGenerator", kwargs=_GENERATOR_KWARGS),
               Call(GENERATOR, "VllmHiddenStatesGenerator.generate", args=("token_ids",))),
        requires=("script-main-ready",),
        script_target=True,
    ),
]
