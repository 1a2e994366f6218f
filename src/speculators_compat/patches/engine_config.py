"""Engine configuration built by hand in ``VllmHiddenStatesGenerator._create_vllm_config``.

What vLLM changed, and how the patches answer (versions: compat_matrix.yaml):
- ``SchedulerConfig`` gained a required ``is_encoder_decoder`` (0.11.1+; speculators 0.3.0 does
  not pass it, 0.4.x does, which 0.11.0 rejects) and turns ``async_scheduling`` on by default
  for hand-built configs (0.14+). The adapter passes ``is_encoder_decoder=False`` where the
  field exists, drops it where it does not. ``SPECULATORS_COMPAT_MAX_NUM_BATCHED_TOKENS`` sets the
  per-step token budget, which speculators 0.3.0 fixes at ``max(8192, max_model_len)`` (where set it
  also wins over 0.4.x's ``max_num_batched_tokens`` argument). ``SchedulerConfig.async_scheduling`` has one owner,
  this patch: ``async_scheduling_wanted`` below is the only decision and this module the only
  writer. It is off when the config is built (vLLM would otherwise turn it on by default, and
  the executor that decides it is not known yet); ``async-scheduling`` (execution.py, which
  ``requires`` this patch) asks ``settle_async_scheduling`` for the final value as the executor
  is built: on only with the pipelined driver, both settings on, and an executor taking futures.
- ``CacheConfig``: prefix caching became the default (0.12+). speculators 0.3.0 neither gives
  its Requests a block hasher nor turns caching off, so vLLM's block pool fails its
  ``len(request.block_hashes) >= num_full_blocks`` assertion (with an empty message) on the
  first prompt longer than a block. The adapter turns prefix caching off, as 0.4.x does: each
  prompt is then computed in full, so repeated calls cannot be served from another call's
  cache. Where vLLM resolves the block size itself (a ``None`` default: the platform and its
  attention backend choose; CPU attention wants multiples of 32 from 0.32), the adapter drops
  speculators' hard-coded 16 and lets vLLM choose, like vLLM's own engine.
- ``ModelConfig(dtype="auto")`` is hard-coded: ``engine-dtype`` passes
  ``SPECULATORS_COMPAT_DTYPE`` instead where it is set (e.g. float32 to verify rows, bfloat16 on a
  CPU that refuses float16); unset, speculators' call is unchanged.
The adapters wrap the names in the generator's module namespace: vLLM itself is untouched.
"""

from __future__ import annotations

from .. import settings
from ..registry import wrapper_patch
from ._signatures import GENERATOR, accepts, import_attr, parameters, require_params


def async_scheduling_wanted(executor_takes_futures: bool) -> bool:
    """The one decision on the generator engine's ``SchedulerConfig.async_scheduling``: on only
    where the pipelined driver keeps batches in flight (``SPECULATORS_COMPAT_PIPELINE``),
    ``SPECULATORS_COMPAT_ASYNC_SCHEDULING`` allows it, and the executor takes futures."""
    return (
        executor_takes_futures
        and settings.flag("SPECULATORS_COMPAT_ASYNC_SCHEDULING")
        and settings.flag("SPECULATORS_COMPAT_PIPELINE")
    )


def settle_async_scheduling(vllm_config, executor_takes_futures: bool) -> None:
    """Write the decided value on the built config (called as the executor is built)."""
    scheduler_config = getattr(vllm_config, "scheduler_config", None)
    if scheduler_config is not None and hasattr(scheduler_config, "async_scheduling"):
        scheduler_config.async_scheduling = bool(async_scheduling_wanted(executor_takes_futures))


def _scheduler_config_args(wrapped, instance, args, kwargs):
    params = parameters(wrapped) or {}
    if "is_encoder_decoder" in params:
        kwargs.setdefault("is_encoder_decoder", False)
    else:
        kwargs.pop("is_encoder_decoder", None)
    if "async_scheduling" in params:
        kwargs.setdefault("async_scheduling", False)  # settled when the executor is built (above)
    budget = settings.number_set("SPECULATORS_COMPAT_MAX_NUM_BATCHED_TOKENS")
    if budget != int(budget) or budget < 0:
        raise settings.SettingError(f"SPECULATORS_COMPAT_MAX_NUM_BATCHED_TOKENS={budget:g}: expected a whole "
                                    "number of tokens (0: speculators' choice)")
    if budget:
        budget = int(budget)
        kwargs["max_num_batched_tokens"] = budget
    return wrapped(*args, **kwargs)


DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float")  # what vLLM's ModelConfig reads


def _model_config_dtype(wrapped, instance, args, kwargs):
    dtype = settings.text("SPECULATORS_COMPAT_DTYPE")
    if dtype:
        if dtype not in DTYPES:
            raise settings.SettingError(f"SPECULATORS_COMPAT_DTYPE={dtype!r}: expected one of {', '.join(DTYPES)}")
        kwargs["dtype"] = dtype
    return wrapped(*args, **kwargs)


def _probe_model_config(current):
    return require_params(import_attr("vllm.config", "ModelConfig"), ("model", "dtype"), "vllm.config.ModelConfig")


def _probe_scheduler_config(current):
    real = import_attr("vllm.config", "SchedulerConfig")
    return require_params(real, ("max_num_seqs", "max_model_len", "max_num_batched_tokens"), "vllm.config.SchedulerConfig")


def block_size_is_resolved_by_vllm(cache_config_cls) -> bool:
    """True where CacheConfig's block_size defaults to None (vLLM picks it per platform/backend)."""
    fields = getattr(cache_config_cls, "__dataclass_fields__", {}) or {}
    f = fields.get("block_size")
    if f is None:
        return False
    default = f.default
    # pydantic dataclasses keep a FieldInfo as the default
    default = getattr(default, "default", default)
    return default is None


def _cache_config_args(wrapped, instance, args, kwargs):
    if accepts(wrapped, "enable_prefix_caching"):
        kwargs["enable_prefix_caching"] = False
    if block_size_is_resolved_by_vllm(wrapped):
        kwargs.pop("block_size", None)
    return wrapped(*args, **kwargs)


def _probe_cache_config(current):
    real = import_attr("vllm.config", "CacheConfig")
    return require_params(real, ("block_size", "gpu_memory_utilization", "enable_prefix_caching"), "vllm.config.CacheConfig")


PATCHES = [
    wrapper_patch(
        "scheduler-config-args",
        "config",
        GENERATOR,
        "SchedulerConfig",
        _scheduler_config_args,
        _probe_scheduler_config,
    ),
    wrapper_patch(
        "engine-dtype",
        "config",
        GENERATOR,
        "ModelConfig",
        _model_config_dtype,
        _probe_model_config,
    ),
    wrapper_patch(
        "cache-config-args",
        "config",
        GENERATOR,
        "CacheConfig",
        _cache_config_args,
        _probe_cache_config,
    ),
]
