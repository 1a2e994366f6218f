"""``Scheduler`` and ``Request`` constructed by hand in the generator.

What vLLM changed, and how the patches answer (versions: compat_matrix.yaml):
- ``Scheduler(...)`` requires ``block_size`` from 0.11.1 (speculators 0.3.0 omits it; 0.4.x
  passes its hard-coded 16, which 0.11.0 rejects) and takes ``hash_block_size`` from 0.20.
  The adapter passes what vLLM's own engine core passes: the scheduler and hash block sizes
  from ``resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)`` where it exists, else the
  resolved ``cache_config.block_size``; it drops ``block_size`` where the parameter is absent.
- ``Request(eos_token_id=...)`` was removed in 0.17. vLLM's engine now carries the model's EOS
  in the sampling parameters: the adapter moves it there with
  ``SamplingParams.update_from_generation_config({}, eos)`` (positional: the keyword was
  renamed in 0.17 too) and constructs the Request without it.
Both adapters wrap the names in the generator's module namespace only.
"""

from __future__ import annotations

from ..registry import wrapper_patch
from ._signatures import GENERATOR, accepts, import_attr, parameters, require_params


def scheduler_block_sizes(vllm_config, kv_cache_config) -> tuple[int, int]:
    """(scheduler block size, hash block size) as vLLM's engine core computes them."""
    import vllm.v1.core.kv_cache_utils as kcu

    resolver = getattr(kcu, "resolve_kv_cache_block_sizes", None)
    if resolver is not None:
        return tuple(resolver(kv_cache_config, vllm_config))  # type: ignore[return-value]
    size = vllm_config.cache_config.block_size
    return size, size


def _scheduler_args(wrapped, instance, args, kwargs):
    params = parameters(wrapped) or {}
    if "block_size" in params:
        block, hashed = scheduler_block_sizes(kwargs["vllm_config"], kwargs["kv_cache_config"])
        kwargs["block_size"] = block
        if "hash_block_size" in params:
            kwargs["hash_block_size"] = hashed
    else:
        kwargs.pop("block_size", None)
    return wrapped(*args, **kwargs)


def _probe_scheduler(current):
    real = import_attr("vllm.v1.core.sched.scheduler", "Scheduler")
    return require_params(real, ("vllm_config", "kv_cache_config", "structured_output_manager"), "Scheduler.__init__")


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
    wrapper_patch("scheduler-args", "scheduler-request", GENERATOR, "Scheduler", _scheduler_args, _probe_scheduler),
    wrapper_patch("request-args", "scheduler-request", GENERATOR, "Request", _request_args, _probe_request),
]
