"""The generator's step loop: ``VllmHiddenStatesGenerator.generate``, replaced as a whole.

Every part of speculators' loop moved in vLLM (split execute/sample steps, single-reply RPCs,
Model Runner V2's finished ids) and both releases return wrong rows silently (0.3.0 truncates
chunked batches, 0.4.x reorders more than ten). ``generate-driver`` runs
``extraction.driver.generate`` instead; ``async-scheduling`` turns the workers' async mode on
with the pipelined driver on accelerators. Details: docs/MODULES.md.
"""

from __future__ import annotations

import sys

from ..extraction.driver import generate
from ..extraction.errors import ExtractionError
from ..extraction.steps import executor_takes_futures
from ..registry import Call, wrapper_patch
from ._signatures import EXECUTOR, GENERATOR, calls_problem, import_attr, parameters
from .scheduler_request import REQUEST_KW


__all__ = ["ExtractionError", "PATCHES", "generate"]


_SCHED = "vllm.v1.core.sched.scheduler"
# the step driver's calls (extraction/driver.py, steps.py, protocol.py): the executor's with
# non_block where it takes futures (the pipelined driver), else blocking; sample_tokens from 0.11.1;
# collective_rpc always with non_block (protocol.fence), and the fence reads each reply queue;
# Request with eos_token_id (request-args moves it into the sampling parameters from 0.17)
DRIVER_CALLS = (
    Call(EXECUTOR, "MultiprocExecutor.collective_rpc", args=("method",), kwargs=("args", "timeout", "non_block")),
    (Call(EXECUTOR, "MultiprocExecutor.execute_model", args=("scheduler_output",), kwargs=("non_block",)),
     Call(EXECUTOR, "MultiprocExecutor.execute_model", args=("scheduler_output",))),
    (Call(EXECUTOR, "MultiprocExecutor.sample_tokens", args=("grammar_output",), kwargs=("non_block",), optional=True),
     Call(EXECUTOR, "MultiprocExecutor.sample_tokens", args=("grammar_output",), optional=True)),
    Call("vllm.distributed.device_communicators.shm_broadcast", "MessageQueue.dequeue", kwargs=("timeout",)),
    Call(_SCHED, "Scheduler.schedule"),
    Call(_SCHED, "Scheduler.add_request", args=("request",)),
    Call(_SCHED, "Scheduler.update_from_output", args=("scheduler_output", "model_runner_output")),
    Call(_SCHED, "Scheduler.finish_requests", args=("request_ids", "finished_status")),
    Call(_SCHED, "Scheduler.has_unfinished_requests"),
    Call(_SCHED, "Scheduler.get_num_unfinished_requests"),
    (Call("vllm.v1.request", "Request", kwargs=REQUEST_KW + ("eos_token_id",)),
     Call("vllm.v1.request", "Request", kwargs=REQUEST_KW)),
    Call("vllm.config", "ModelConfig.get_vocab_size"),
    Call("vllm.config", "ModelConfig.get_hidden_size"),
)


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
    return calls_problem(DRIVER_CALLS)


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
    # scheduler-config-args owns SchedulerConfig.async_scheduling (engine_config.py decides it); only
    # the generator's executor, before its workers start with the config (Executor.__init__)
    from .engine_config import settle_async_scheduling
    from .executor import CONSTRUCTING

    if CONSTRUCTING.get() is not None:
        config = kwargs.get("vllm_config", args[0] if args else None)
        settle_async_scheduling(config, executor_takes_futures(type(instance)))
    return wrapped(*args, **kwargs)


def _probe_async_scheduling(current):
    from ..registry import NotNeeded

    params = list(parameters(current) or {})
    if params[:2] != ["self", "vllm_config"]:
        return f"expected MultiprocExecutor.__init__(self, vllm_config, ...); found {params or current!r}"
    import inspect

    # (unwrapped: vLLM 0.32 decorates it with its tracing span)
    base_init = getattr(inspect.unwrap(import_attr("vllm.v1.executor.abstract", "Executor.__init__")), "__code__", None)
    if base_init is None or "_init_executor" not in base_init.co_names:  # the workers start in it
        return "expected Executor.__init__ to start the workers (self._init_executor()); it does not"
    real = import_attr(EXECUTOR, "MultiprocExecutor")
    if not executor_takes_futures(real):
        return (
            "expected MultiprocExecutor.execute_model/sample_tokens/collective_rpc(..., non_block=...); "
            f"found execute_model{parameters(real.execute_model)}"
        )
    worker_proc = import_attr(EXECUTOR, "WorkerProc")
    if not callable(getattr(worker_proc, "async_output_busy_loop", None)):
        return "expected WorkerProc.async_output_busy_loop (the workers' async output thread); not found"
    fields = getattr(import_attr("vllm.config", "SchedulerConfig"), "__dataclass_fields__", {}) or {}
    if "async_scheduling" not in fields:
        return "expected SchedulerConfig.async_scheduling; not found"
    from .engine_options import on_cpu

    if on_cpu():
        return NotNeeded("the CPU platform runs without async scheduling (vLLM turns it off there)")
    return None


PATCHES = [
    wrapper_patch(
        "async-scheduling",
        "execution",
        EXECUTOR,
        "MultiprocExecutor.__init__",
        _executor_async_scheduling,
        _probe_async_scheduling,
        # the one writer of SchedulerConfig.async_scheduling; futures only the shim's driver drives;
        # the generator being built (generator-construction) is the only executor it touches
        requires=("scheduler-config-args", "generate-driver", "generator-construction"),
    ),
    wrapper_patch(
        "generate-driver",
        "execution",
        GENERATOR,
        "VllmHiddenStatesGenerator.generate",
        _replace_generate,
        _probe_generate,
        calls=DRIVER_CALLS,
        # the driver passes eos_token_id= to Request (request-args from 0.17) and talks to the
        # worker capture through its RPC
        requires=("request-args", "worker-capture-rpc"),
    ),
]
