"""Engine configuration built by hand in ``VllmHiddenStatesGenerator._create_vllm_config``.

``scheduler-config-args``: ``is_encoder_decoder`` where the field exists, the token budget
(``SPECULATORS_COMPAT_MAX_NUM_BATCHED_TOKENS``), and the one decision on ``async_scheduling``
(off at build, settled as the executor is built). ``engine-dtype``: ``SPECULATORS_COMPAT_DTYPE``.
``cache-config-args``: prefix caching off and the platform's block size (0.12+).
Versions: compat_matrix.yaml. Details: docs/MODULES.md.
"""

from __future__ import annotations

from .. import settings
from ..registry import Call, wrapper_patch
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


_SCHEDULER_CONFIG_KW = ("max_num_seqs", "max_model_len", "max_num_batched_tokens")
SCHEDULER_CONFIG_FORMS = tuple(
    Call("vllm.config", "SchedulerConfig", kwargs=_SCHEDULER_CONFIG_KW + extra)
    for extra in (("is_encoder_decoder", "async_scheduling"), ("async_scheduling",), ("is_encoder_decoder",), ())
)

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
    return require_params(real, _SCHEDULER_CONFIG_KW, "vllm.config.SchedulerConfig")


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
        # speculators' SchedulerConfig(...), is_encoder_decoder and async_scheduling added where they exist
        calls=(SCHEDULER_CONFIG_FORMS,),
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
        calls=(Call("vllm.config", "CacheConfig", kwargs=("gpu_memory_utilization", "enable_prefix_caching")),),
    ),
]
