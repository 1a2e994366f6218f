"""``Scheduler`` and ``Request`` constructed by hand in the generator.

``Scheduler(...)`` gets the block sizes vLLM's engine core passes (``block_size`` from 0.11.1,
``hash_block_size`` from 0.20, the KV-cache groups' block size); ``Request(eos_token_id=)`` (gone
in 0.17) moves the EOS into the sampling parameters as vLLM's engine does.
Versions: compat_matrix.yaml. Details: docs/MODULES.md.
"""

from __future__ import annotations

from ..registry import Call, wrapper_patch
from ._signatures import GENERATOR, accepts, first_binding, import_attr, parameters, require_params

SCHEDULER = "vllm.v1.core.sched.scheduler"
_SCHED_KW = ("vllm_config", "kv_cache_config", "structured_output_manager")
# Scheduler(...) as the adapter calls it: the first form that binds to the installed signature
SCHEDULER_FORMS = (
    Call(SCHEDULER, "Scheduler", kwargs=_SCHED_KW + ("block_size", "hash_block_size")),  # 0.20+
    Call(SCHEDULER, "Scheduler", kwargs=_SCHED_KW + ("block_size",)),  # 0.11.1+
    Call(SCHEDULER, "Scheduler", kwargs=_SCHED_KW),  # 0.11.0
)
BLOCK_SIZE_CALLS = (
    Call("vllm.v1.core.kv_cache_utils", "resolve_kv_cache_block_sizes", args=("kv_cache_config", "vllm_config"), optional=True),
)
# the engine core's view of the KV-cache config for its scheduler (a list: one config per worker)
SCHEDULER_VIEW_FORMS = (
    Call("vllm.v1.core.kv_cache_utils", "generate_scheduler_kv_cache_config", args=("kv_cache_configs",), optional=True),
    Call("vllm.v1.core.kv_cache_planning", "generate_scheduler_kv_cache_config", args=("kv_cache_configs",), optional=True),
)


def scheduler_kv_cache_config(kv_cache_config):
    """The config vLLM's engine core hands its scheduler: ``generate_scheduler_kv_cache_config``
    of the workers' configs where vLLM has it (a copy; uniform-type groups become one spec),
    else the config itself."""
    for form in SCHEDULER_VIEW_FORMS if kv_cache_config is not None else ():
        try:
            view = import_attr(form.module, form.attr)
        except (ImportError, AttributeError):
            continue
        return view([kv_cache_config])
    return kv_cache_config


def block_size_from_groups(vllm_config, kv_cache_config) -> int | None:
    """vLLM's engine core: ``cache_config.block_size`` := the smallest block size of the
    prefix-cacheable KV-cache groups (of all groups if none is). Returns the size set, or None
    where there are no groups (attention-free models: left as it is)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if not groups:
        return None
    participating = [g.kv_cache_spec.block_size for g in groups if getattr(g.kv_cache_spec, "prefix_cacheable", True)]
    size = min(participating or [g.kv_cache_spec.block_size for g in groups])
    vllm_config.cache_config.block_size = size
    return size


def scheduler_block_sizes(vllm_config, kv_cache_config) -> tuple[int, int]:
    """(scheduler block size, hash block size) as vLLM's engine core computes them, after taking
    the block size from the KV-cache groups."""
    import vllm.v1.core.kv_cache_utils as kcu

    block_size_from_groups(vllm_config, kv_cache_config)
    resolver = getattr(kcu, "resolve_kv_cache_block_sizes", None)
    if resolver is not None:
        return tuple(resolver(kv_cache_config, vllm_config))  # type: ignore[return-value]
    parallel = vllm_config.parallel_config
    size = (
        vllm_config.cache_config.block_size
        * getattr(parallel, "decode_context_parallel_size", 1)
        * getattr(parallel, "prefill_context_parallel_size", 1)
    )
    return size, size


def _scheduler_args(wrapped, instance, args, kwargs):
    form, problem = first_binding(SCHEDULER_FORMS, wrapped)
    if form is None:
        raise TypeError(f"speculators_compat: no known call of Scheduler binds: {problem}")
    kwargs["kv_cache_config"] = scheduler_kv_cache_config(kwargs["kv_cache_config"])
    block, hashed = scheduler_block_sizes(kwargs["vllm_config"], kwargs["kv_cache_config"])
    kwargs.pop("block_size", None)
    kwargs.pop("hash_block_size", None)
    if "block_size" in form.kwargs:
        kwargs["block_size"] = block
    if "hash_block_size" in form.kwargs:
        kwargs["hash_block_size"] = hashed
    return wrapped(*args, **kwargs)


def _probe_scheduler(current):
    real = import_attr(SCHEDULER, "Scheduler")
    return first_binding(SCHEDULER_FORMS, real)[1]


REQUEST_KW = ("request_id", "prompt_token_ids", "sampling_params", "pooling_params", "arrival_time")
# Request(...) as speculators calls it (0.4.x adds block_hasher=), without eos_token_id where the
# adapter moved it into the sampling parameters (0.17+)
REQUEST_FORMS = (
    Call("vllm.v1.request", "Request", kwargs=REQUEST_KW + ("eos_token_id",), speculators="==0.3.0"),
    Call("vllm.v1.request", "Request", kwargs=REQUEST_KW, speculators="==0.3.0"),
    Call("vllm.v1.request", "Request", kwargs=REQUEST_KW + ("block_hasher", "eos_token_id"), speculators=">=0.4"),
    Call("vllm.v1.request", "Request", kwargs=REQUEST_KW + ("block_hasher",), speculators=">=0.4"),
)
# where Request has no eos_token_id: the EOS goes in positionally (the keyword was renamed in 0.17)
UPDATE_EOS_CALL = Call("vllm.sampling_params", "SamplingParams.update_from_generation_config", args=("generation_config", "eos_token_id"))


def _request_args(wrapped, instance, args, kwargs):
    if "eos_token_id" in kwargs and not accepts(wrapped, "eos_token_id"):
        eos = kwargs.pop("eos_token_id")
        params = kwargs.get("sampling_params")
        if params is not None and eos is not None:
            params.update_from_generation_config({}, eos)
    return wrapped(*args, **kwargs)


def _probe_request(current):
    real = import_attr("vllm.v1.request", "Request")
    problem = require_params(real, ("request_id", "prompt_token_ids", "sampling_params", "pooling_params"), "Request.__init__")
    if problem:
        return problem
    if not accepts(real, "eos_token_id"):
        sp = import_attr("vllm.sampling_params", "SamplingParams")
        upd = getattr(sp, "update_from_generation_config", None)
        if upd is None or len(parameters(upd) or {}) < 3:
            return (
                "Request has no eos_token_id parameter; expected "
                "SamplingParams.update_from_generation_config(self, generation_config, eos) to carry it; not found"
            )
    return None


PATCHES = [
    wrapper_patch(
        "scheduler-args", "scheduler-request", GENERATOR, "Scheduler", _scheduler_args, _probe_scheduler,
        calls=(SCHEDULER_FORMS, SCHEDULER_VIEW_FORMS) + BLOCK_SIZE_CALLS,
    ),
    wrapper_patch(
        "request-args", "scheduler-request", GENERATOR, "Request", _request_args, _probe_request,
        calls=(REQUEST_FORMS, UPDATE_EOS_CALL),
    ),
]
