"""The generator's executor: speculators hard-codes vLLM's ``MultiprocExecutor`` (one host).

``generator-construction`` marks the generator whose ``__init__`` runs (``CONSTRUCTING``).
``executor-backend``: ``SPECULATORS_COMPAT_EXECUTOR=ray`` / ``..._PIPELINE_PARALLEL_SIZE=N`` reach
``ParallelConfig``. ``executor-class`` owns the name ``MultiprocExecutor`` the generator builds by:
with Ray or pipeline stages, vLLM's own executor choice (with per-stage KV-cache configs).
``worker-spawn``: on accelerators the workers start with ``spawn``. Nothing changes unless asked;
Ray is imported only when asked for. Details: docs/MODULES.md.
"""

from __future__ import annotations

import contextvars
import os
import sys

from .. import settings
from ..registry import Call, wrapper_patch
from ..extraction.steps import executor_takes_futures
from ._signatures import EXECUTOR, GENERATOR, import_attr, parameters, require_params

EXECUTORS = ("mp", "ray")

# the generator whose __init__ is running (set by generator-construction for the call): what a patch
# on a function that __init__ calls reads instead of walking the stack (kv-cache-hybrid-groups)
CONSTRUCTING: contextvars.ContextVar = contextvars.ContextVar("speculators_compat_generator_init", default=None)


class ExecutorChoiceError(ValueError):
    """The executor asked for cannot be built (bad setting, or vLLM does not run it here)."""


def choice() -> str:
    """The executor asked for: ``mp`` (default, speculators' MultiprocExecutor) or ``ray``."""
    raw = settings.text("SPECULATORS_COMPAT_EXECUTOR")
    value = (raw or "mp").strip().lower()
    if value not in EXECUTORS:
        raise settings.SettingError(f"SPECULATORS_COMPAT_EXECUTOR={raw!r}: expected one of {', '.join(EXECUTORS)}")
    return value


def pipeline_parallel_size() -> int:
    raw = settings.number("SPECULATORS_COMPAT_PIPELINE_PARALLEL_SIZE")
    if raw is None:
        return 1
    if raw != int(raw):
        raise settings.SettingError(f"SPECULATORS_COMPAT_PIPELINE_PARALLEL_SIZE={raw!r}: expected a whole number ≥ 1")
    return int(raw)


def custom_engine() -> bool:
    return choice() != "mp" or pipeline_parallel_size() > 1


# -- executor-backend: ParallelConfig ------------------------------------------------------


def _parallel_config_args(wrapped, instance, args, kwargs):
    if choice() == "ray":
        kwargs["distributed_executor_backend"] = "ray"
    pp = pipeline_parallel_size()
    if pp > 1:
        kwargs["pipeline_parallel_size"] = pp
    return wrapped(*args, **kwargs)


def _probe_parallel_config(current):
    import inspect

    real = import_attr("vllm.config", "ParallelConfig")
    problem = require_params(
        real,
        ("tensor_parallel_size", "worker_extension_cls", "pipeline_parallel_size", "distributed_executor_backend"),
        "vllm.config.ParallelConfig",
    )
    if problem:
        return problem
    try:  # the call the adapter makes, bound to the installed signature (nothing is built)
        inspect.signature(real).bind(
            tensor_parallel_size=2,
            worker_extension_cls="speculators.data_generation.custom_worker.HiddenStatesWorkerExtension",
            pipeline_parallel_size=2,
            distributed_executor_backend="ray",
        )
    except TypeError as exc:
        return ("expected ParallelConfig(tensor_parallel_size, worker_extension_cls, pipeline_parallel_size, "
                f"distributed_executor_backend) to bind; {exc}")
    return None


# -- executor-class: the generator module's MultiprocExecutor -------------------------------


def _check_platform_runs_ray() -> None:
    from vllm.platforms import current_platform

    if not getattr(current_platform, "ray_device_key", ""):
        name = getattr(current_platform, "device_name", None) or type(current_platform).__name__
        raise ExecutorChoiceError(
            f"SPECULATORS_COMPAT_EXECUTOR=ray: vLLM's Ray executor does not run on the {name} platform "
            f"(vLLM: 'current platform {name} does not support ray.'); unset it to use MultiprocExecutor"
        )


def _import_ray_or_explain() -> None:
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        raise ExecutorChoiceError(
            f"SPECULATORS_COMPAT_EXECUTOR=ray needs Ray: pip install 'speculators-compat[ray]' ({exc})"
        ) from None


def merged_stage_specs(result):
    """``get_kv_cache_spec``'s replies (one per rank): rank 0's answer holds every stage's layers."""
    merged = {}
    for spec in result:
        merged.update(spec)
    return [merged, *result[1:]]


def _keep_own(items, names_attr: str, mine: set) -> list:
    """Copies of ``items`` (KV-cache groups or tensors) whose ``names_attr`` list keeps only the
    layers in ``mine``; items with none of them left out."""
    import copy

    out = []
    for item in items:
        names = [n for n in getattr(item, names_attr) if n in mine]
        if names:
            kept = copy.copy(item)
            setattr(kept, names_attr, names)
            out.append(kept)
    return out


def per_rank_configs(config, stage_specs: list[dict]):
    """One KV-cache config per global rank from a config over every stage's layers: each keeps
    the groups and tensors of its own layers (vLLM's engine core gives each worker its own)."""
    import copy

    out = []
    for spec in stage_specs:
        mine = set(spec)
        c = copy.copy(config)
        groups = _keep_own(config.kv_cache_groups, "layer_names", mine)
        tensors = _keep_own(config.kv_cache_tensors, "shared_by", mine)
        c.kv_cache_groups, c.kv_cache_tensors = groups, tensors
        out.append(c)
    return out


def pipeline_stages(cls: type) -> type:
    """``cls`` for a generator with pipeline stages: ``get_kv_cache_spec`` answers, at rank 0,
    every stage's layers (speculators plans the KV cache from rank 0's answer), and
    ``initialize_from_config`` hands each global rank the config of its own layers."""

    class PipelineStages(cls):  # type: ignore[misc, valid-type]
        _speculators_compat_stage_specs = None

        def collective_rpc(self, method, *args, **kwargs):
            result = super().collective_rpc(method, *args, **kwargs)
            if method == "get_kv_cache_spec" and isinstance(result, list) and result:
                self._speculators_compat_stage_specs = [dict(r) for r in result]
                result = merged_stage_specs(result)
            return result

        def initialize_from_config(self, kv_cache_configs):
            specs = self._speculators_compat_stage_specs
            if specs and len(kv_cache_configs) < self.vllm_config.parallel_config.world_size:
                kv_cache_configs = per_rank_configs(kv_cache_configs[0], specs)
            return super().initialize_from_config(kv_cache_configs)

    PipelineStages.__qualname__ = f"PipelineStages[{cls.__qualname__}]"
    return PipelineStages


def ordered_control_plane(executor_cls) -> bool:
    """True where shim RPCs and model steps travel through one ordered queue per worker
    (MultiprocExecutor and its subclasses, e.g. vLLM's RayExecutorV2)."""
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    return isinstance(executor_cls, type) and issubclass(executor_cls, MultiprocExecutor)


def build_executor(vllm_config, multiproc: type):
    """vLLM's own executor for this config (``Executor.get_class``): Ray where asked for, else
    ``multiproc`` (the generator module's ``MultiprocExecutor``); with pipeline stages, a subclass
    that plans every stage's KV cache."""
    cls = multiproc
    if vllm_config.parallel_config.distributed_executor_backend == "ray":
        from vllm.v1.executor.abstract import Executor

        from .engine_config import settle_async_scheduling

        cls = Executor.get_class(vllm_config)
        settle_async_scheduling(vllm_config, ordered_control_plane(cls) and executor_takes_futures(cls))
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        cls = pipeline_stages(cls)
    return cls(vllm_config=vllm_config)


def _mark_construction(wrapped, instance, args, kwargs):
    token = CONSTRUCTING.set(instance)
    try:
        return wrapped(*args, **kwargs)
    finally:
        CONSTRUCTING.reset(token)


def _probe_generator_init(current):
    original = getattr(current, "__wrapped__", current)
    if parameters(original) is None:
        return f"expected VllmHiddenStatesGenerator.__init__ to be a Python function; found {current!r}"
    return None


def _executor_class(wrapped, instance, args, kwargs):
    """``MultiprocExecutor(vllm_config=...)`` as the generator calls it: unchanged unless Ray or
    pipeline stages are asked for while a generator is built."""
    if CONSTRUCTING.get() is None or not custom_engine():
        return wrapped(*args, **kwargs)
    if choice() == "ray":
        _check_platform_runs_ray()
        _import_ray_or_explain()
    return build_executor(kwargs.get("vllm_config", args[0] if args else None), wrapped)


def _probe_executor_class(current):
    init = getattr(sys.modules[GENERATOR].VllmHiddenStatesGenerator, "__init__", None)
    init = getattr(init, "__wrapped__", init)
    code = getattr(init, "__code__", None)
    if code is None or "MultiprocExecutor" not in code.co_names:
        return "expected VllmHiddenStatesGenerator.__init__ to build MultiprocExecutor by name; it does not"
    if not isinstance(current, type):
        return f"expected the generator module's MultiprocExecutor to be vLLM's class; found {current!r}"
    get_class = import_attr("vllm.v1.executor.abstract", "Executor.get_class")
    params = parameters(get_class)
    if params is None or list(params)[:1] != ["vllm_config"]:
        return f"expected Executor.get_class(vllm_config); found {params and list(params)}"
    return None


# -- worker-spawn: the workers' start method ---------------------------------------------------

SPAWN_ENV = "VLLM_WORKER_MULTIPROC_METHOD"


def _spawn_context(wrapped, instance, args, kwargs):
    """``get_mp_context()`` while the generator is built on an accelerator, with no method chosen
    by the user: vLLM's own answer where it sees CUDA initialised, the spawn context. vLLM forks
    otherwise, but a caller that only asked ``torch.cuda.is_available()`` has touched the driver,
    and every forked worker dies ("Cannot re-initialize CUDA in forked subprocess"; H200, vLLM
    0.24). Nothing is set in the environment."""
    import multiprocessing

    from .engine_options import on_cpu

    context = wrapped(*args, **kwargs)  # vLLM's own checks and settings, as always
    if CONSTRUCTING.get() is None or SPAWN_ENV in os.environ or on_cpu():
        return context
    return multiprocessing.get_context("spawn")


def _probe_spawn_context(current):
    params = parameters(current)
    if params is None:
        return f"expected {EXECUTOR}.get_mp_context(); found {current!r}, whose signature cannot be read"
    if params:
        return f"expected {EXECUTOR}.get_mp_context(); found parameters {list(params)}"
    starters = []
    for starter in ("MultiprocExecutor._init_executor", "WorkerProc.make_worker_process"):
        try:
            starters.append(import_attr(EXECUTOR, starter))
        except AttributeError:
            continue
    scope = getattr(sys.modules.get(EXECUTOR), "__dict__", None)
    # the starter must look the name up in this module's globals: that is the name the patch replaces
    if not any("get_mp_context" in getattr(getattr(f, "__code__", None), "co_names", ())
               and getattr(f, "__globals__", None) is scope is not None for f in starters):
        return ("expected MultiprocExecutor to start its workers from its module's get_mp_context(); "
                "it does not call it")
    return None


PATCHES = [
    wrapper_patch(
        "generator-construction",
        "executor",
        GENERATOR,
        "VllmHiddenStatesGenerator.__init__",
        _mark_construction,
        _probe_generator_init,
    ),
    wrapper_patch(
        "executor-backend",
        "executor",
        GENERATOR,
        "ParallelConfig",
        _parallel_config_args,
        _probe_parallel_config,
        calls=(Call("vllm.config", "ParallelConfig", kwargs=("tensor_parallel_size", "worker_extension_cls",
                                                              "pipeline_parallel_size", "distributed_executor_backend")),),
        requires=("executor-class",),  # a Ray/PP config needs vLLM's executor choice and per-rank KV configs
    ),
    wrapper_patch(
        "executor-class",
        "executor",
        GENERATOR,
        "MultiprocExecutor",
        _executor_class,
        _probe_executor_class,
        # Ray / PP: vLLM's own executor choice; MultiprocExecutor(vllm_config=) is speculators' call (check's G rows)
        calls=(Call("vllm.v1.executor.abstract", "Executor.get_class", args=("vllm_config",)),),
        requires=("generator-construction",),  # it acts only while a generator is built
    ),
    wrapper_patch(
        "worker-spawn",
        "executor",
        EXECUTOR,
        "get_mp_context",
        _spawn_context,
        _probe_spawn_context,
        calls=(Call(EXECUTOR, "get_mp_context"),),
        requires=("generator-construction",),  # it acts only while a generator is built
    ),
]
