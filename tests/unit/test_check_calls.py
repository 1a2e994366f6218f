"""check binds every declared call (registry.Call) against the installed signature.

The vLLM callables are stand-ins with the signatures real releases have (copied from their
sources); the declarations are the shim's own (the same objects its patches call through), so
a declaration that stops binding is a check failure here, not only on a real release."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest

from speculators_compat.check import EXIT_DRIFT, EXIT_UNTESTED, Finding, call_findings, verdict
from speculators_compat.patches import execution, kv_cache, scheduler_request
from speculators_compat.patches._signatures import bind_problem, first_binding
from speculators_compat.registry import Call

pytestmark = pytest.mark.unit


@pytest.fixture
def fake_vllm(monkeypatch):
    """A module to hold one release's stand-in callables; declared calls are re-pointed at it."""
    name = "sc_fake_vllm_release"
    module = types.ModuleType(name)
    monkeypatch.setitem(sys.modules, name, module)

    def repoint(spec):
        forms = spec if isinstance(spec, tuple) else (spec,)
        return tuple(dataclasses.replace(f, module=name) for f in forms)

    module.repoint = repoint
    return module


def _exit_code(spec) -> tuple[int, Finding]:
    finding = call_findings("patch x", spec, "0.4.0.1")
    return verdict([finding], verified=False, broken=False), finding


# -- set_kv_cache_layout: (self, layout_name) until 0.32, (self, layout_name, cp_kv_cache_interleave_size) in 0.33


class Executor032:
    def set_kv_cache_layout(self, layout_name: str) -> None: ...


class Executor033:
    def set_kv_cache_layout(self, layout_name: str, cp_kv_cache_interleave_size: int) -> None: ...


@pytest.mark.parametrize("executor", [Executor032, Executor033])
def test_set_kv_cache_layout_forms_bind_on_032_and_033(fake_vllm, executor):
    fake_vllm.MultiprocExecutor = executor
    code, finding = _exit_code(fake_vllm.repoint(kv_cache.SET_LAYOUT_FORMS))
    assert code == EXIT_UNTESTED and finding.status == "ok", finding


def test_033_without_the_interleave_form_is_drift_naming_the_parameter(fake_vllm):
    """fix 2(b) disabled: only the one-argument call the shim made up to 0.32."""
    fake_vllm.MultiprocExecutor = Executor033
    code, finding = _exit_code(fake_vllm.repoint(kv_cache.SET_LAYOUT_FORMS[1:]))
    assert code == EXIT_DRIFT
    assert "set_kv_cache_layout" in finding.name
    assert "set_kv_cache_layout" in finding.detail and "cp_kv_cache_interleave_size" in finding.detail


def test_resolve_layout_passes_the_interleave_size_where_the_signature_asks(monkeypatch):
    calls = []

    class Exec(Executor033):
        def get_kv_cache_specs(self):
            return [{}]

        def get_supported_kv_cache_layouts(self):
            return [["NHD"]]

        def set_kv_cache_layout(self, layout_name, cp_kv_cache_interleave_size):
            calls.append((layout_name, cp_kv_cache_interleave_size))

    utils = types.ModuleType("vllm.v1.attention.backends.utils")
    utils.resolve_kv_cache_layout = lambda vllm_config, supported, specs: types.SimpleNamespace(name="NHD")
    for mod in ("vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends"):
        monkeypatch.setitem(sys.modules, mod, sys.modules.get(mod) or types.ModuleType(mod))
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.backends.utils", utils)
    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(cp_kv_cache_interleave_size=7))
    assert kv_cache.resolve_layout(Exec(), config) == "NHD"
    assert calls == [("NHD", 7)]

    class Old(Exec):
        def set_kv_cache_layout(self, layout_name):
            calls.append((layout_name,))

    calls.clear()
    kv_cache.resolve_layout(Old(), config)
    assert calls == [("NHD",)]


# -- Scheduler: no block_size (0.11.0), block_size required (0.11.1), + hash_block_size (0.20)


class Scheduler0110:
    def __init__(self, vllm_config, kv_cache_config, structured_output_manager, mm_registry=None, include_finished_set=False, log_stats=False): ...


class Scheduler0111:
    def __init__(self, vllm_config, kv_cache_config, structured_output_manager, block_size, mm_registry=None): ...


class Scheduler020:
    def __init__(self, vllm_config, kv_cache_config, structured_output_manager, block_size, hash_block_size=None): ...


class SchedulerFuture:
    """a release that adds a required parameter no declared form passes"""

    def __init__(self, vllm_config, kv_cache_config, structured_output_manager, block_size, hash_block_size, page_size): ...


@pytest.mark.parametrize("cls,ok", [(Scheduler0110, True), (Scheduler0111, True), (Scheduler020, True), (SchedulerFuture, False)])
def test_scheduler_forms(fake_vllm, cls, ok):
    fake_vllm.Scheduler = cls
    code, finding = _exit_code(fake_vllm.repoint(scheduler_request.SCHEDULER_FORMS))
    assert (code, finding.status) == ((EXIT_UNTESTED, "ok") if ok else (EXIT_DRIFT, "drift")), finding
    if not ok:
        assert "page_size" in finding.detail


def test_scheduler_adapter_passes_the_form_that_binds_with_the_groups_block_size():
    seen = {}

    def make(cls):
        def scheduler(**kwargs):
            seen.clear()
            seen.update(kwargs)

        scheduler.__signature__ = __import__("inspect").signature(cls)
        return scheduler

    spec = types.SimpleNamespace(block_size=128, prefix_cacheable=True)
    kv_config = types.SimpleNamespace(kv_cache_groups=[types.SimpleNamespace(kv_cache_spec=spec)])
    config = types.SimpleNamespace(
        cache_config=types.SimpleNamespace(block_size=16),
        parallel_config=types.SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1),
    )
    kcu = types.ModuleType("vllm.v1.core.kv_cache_utils")  # a release without resolve_kv_cache_block_sizes
    saved = {m: sys.modules.get(m) for m in ("vllm", "vllm.v1", "vllm.v1.core", "vllm.v1.core.kv_cache_utils")}
    try:
        for m in ("vllm", "vllm.v1", "vllm.v1.core"):
            sys.modules[m] = sys.modules.get(m) or types.ModuleType(m)
        sys.modules["vllm.v1.core.kv_cache_utils"] = kcu
        for cls, expect in [
            (Scheduler020, {"block_size": 128, "hash_block_size": 128}),
            (Scheduler0111, {"block_size": 128}),
            (Scheduler0110, {}),
        ]:
            config.cache_config.block_size = 16
            scheduler_request._scheduler_args(make(cls), None, (), dict(vllm_config=config, kv_cache_config=kv_config, structured_output_manager=None, block_size=16))
            assert {k: v for k, v in seen.items() if k in ("block_size", "hash_block_size")} == expect, cls
            assert config.cache_config.block_size == 128  # the engine's copy from the groups
    finally:
        for m, mod in saved.items():
            if mod is None:
                sys.modules.pop(m, None)
            else:
                sys.modules[m] = mod


def test_block_size_from_groups_prefers_prefix_cacheable_groups():
    groups = [
        types.SimpleNamespace(kv_cache_spec=types.SimpleNamespace(block_size=8, prefix_cacheable=False)),
        types.SimpleNamespace(kv_cache_spec=types.SimpleNamespace(block_size=64, prefix_cacheable=True)),
    ]
    config = types.SimpleNamespace(cache_config=types.SimpleNamespace(block_size=16))
    assert scheduler_request.block_size_from_groups(config, types.SimpleNamespace(kv_cache_groups=groups)) == 64
    assert config.cache_config.block_size == 64
    assert scheduler_request.block_size_from_groups(config, types.SimpleNamespace(kv_cache_groups=[])) is None
    assert config.cache_config.block_size == 64


# -- get_kv_cache_config_from_groups: kv_cache_specs required (0.11), gone (0.12+)


def kv_config_011(vllm_config, kv_cache_groups, kv_cache_specs, available_memory): ...


def kv_config_012(vllm_config, kv_cache_groups, available_memory): ...


def kv_config_resigned(vllm_config, groups): ...


@pytest.mark.parametrize("fn,ok", [(kv_config_011, True), (kv_config_012, True), (kv_config_resigned, False)])
def test_kv_cache_config_forms(fake_vllm, fn, ok):
    fake_vllm.get_kv_cache_config_from_groups = fn
    code, finding = _exit_code(fake_vllm.repoint(kv_cache.KV_CONFIG_FORMS))
    assert code == (EXIT_UNTESTED if ok else EXIT_DRIFT), finding
    form, _ = first_binding(fake_vllm.repoint(kv_cache.KV_CONFIG_FORMS))
    if fn is kv_config_011:
        assert "kv_cache_specs" in form.kwargs
    if fn is kv_config_012:
        assert "kv_cache_specs" not in form.kwargs


# -- Request: eos_token_id removed in 0.17 (the adapter drops it); update_from_generation_config carries it


def request_016(request_id, prompt_token_ids, sampling_params, pooling_params, eos_token_id, arrival_time=None, block_hasher=None): ...


def request_017(request_id, prompt_token_ids, sampling_params, pooling_params, client_index=0, arrival_time=None, block_hasher=None): ...


def request_future(request_id, prompt_token_ids, sampling_params, pooling_params, *, tenant, arrival_time=None, block_hasher=None): ...


@pytest.mark.parametrize("fn,ok", [(request_016, True), (request_017, True), (request_future, False)])
def test_request_forms(fake_vllm, fn, ok):
    fake_vllm.Request = fn
    code, finding = _exit_code(fake_vllm.repoint(scheduler_request.REQUEST_FORMS))
    assert code == (EXIT_UNTESTED if ok else EXIT_DRIFT), finding
    if not ok:
        assert "tenant" in finding.detail


def test_request_forms_are_per_speculators_release(fake_vllm):
    fake_vllm.Request = request_017
    forms = fake_vllm.repoint(scheduler_request.REQUEST_FORMS)
    assert "block_hasher" not in call_findings("p", forms, "0.3.0").name
    assert "block_hasher" in call_findings("p", forms, "0.4.0.1").name


# -- mechanics


def test_methods_bind_with_their_instance_and_optional_calls_may_be_absent(fake_vllm):
    fake_vllm.MultiprocExecutor = Executor032
    assert bind_problem(Call(fake_vllm.__name__, "MultiprocExecutor.set_kv_cache_layout", args=("a",))) is None
    assert "missing" in bind_problem(Call(fake_vllm.__name__, "MultiprocExecutor.set_kv_cache_layout"))
    assert "too many positional" in bind_problem(Call(fake_vllm.__name__, "MultiprocExecutor.set_kv_cache_layout", args=("a", "b")))
    assert bind_problem(Call(fake_vllm.__name__, "gone", optional=True)) is None
    assert "not found" in bind_problem(Call(fake_vllm.__name__, "gone"))


def test_every_patch_declares_its_calls_with_known_targets():
    from speculators_compat.patches import all_patches

    by_id = {p.id: p for p in all_patches()}
    for pid in ("kv-cache-config-args", "kv-cache-layout", "scheduler-args", "request-args", "generate-driver",
                "worker-capture-hooks", "worker-capture-rpc", "script-tp-default", "device-name-no-accelerator"):
        assert by_id[pid].calls, pid
        for spec in by_id[pid].calls:
            for form in spec if isinstance(spec, tuple) else (spec,):
                assert isinstance(form, Call) and form.module.split(".")[0] in ("vllm", "speculators", "torch"), (pid, form)


# -- the step driver: the executor's calls with non_block (0.11.1+ futures) or blocking (before the split)


class ExecutorPipelined:  # 0.14-0.32
    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False, unique_reply_rank=None): ...
    def execute_model(self, scheduler_output, non_block=False): ...
    def sample_tokens(self, grammar_output, non_block=False): ...


class ExecutorBlocking:  # a release without non_block (as before 0.11), no sample_tokens
    def collective_rpc(self, method, timeout=None, args=(), kwargs=None): ...
    def execute_model(self, scheduler_output): ...


class ExecutorNewParam:  # a release whose execute_model requires one more argument
    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False): ...
    def execute_model(self, scheduler_output, grammar_output, non_block=False): ...
    def sample_tokens(self, grammar_output, non_block=False): ...


def _driver_executor_calls():
    return [spec for spec in execution.DRIVER_CALLS
            if (spec[0] if isinstance(spec, tuple) else spec).attr.startswith("MultiprocExecutor.")]


@pytest.mark.parametrize("executor", [ExecutorPipelined, ExecutorBlocking])
def test_driver_calls_on_pipelined_and_blocking_executors(fake_vllm, executor):
    fake_vllm.MultiprocExecutor = executor
    specs = _driver_executor_calls()
    assert len(specs) == 3
    for spec in specs:
        code, finding = _exit_code(fake_vllm.repoint(spec))
        if executor is ExecutorBlocking and "collective_rpc" in finding.name:
            # protocol.fence re-synchronises the replies with collective_rpc(non_block=True): no blocking form
            assert code == EXIT_DRIFT and "non_block" in finding.detail, finding
            continue
        assert code == EXIT_UNTESTED and finding.status == "ok", finding
        absent = executor is ExecutorBlocking and "sample_tokens" in finding.name
        assert ("absent here" in finding.detail) == absent, finding  # optional and not there: said so


def test_a_present_form_that_drifted_is_drift_although_an_optional_form_is_absent(fake_vllm):
    from speculators_compat.patches._signatures import calls_problem

    fake_vllm.moved = lambda kv_cache_configs, extra: None  # the one that is there needs one more argument
    forms = (Call(fake_vllm.__name__, "gone", args=("kv_cache_configs",), optional=True),
             Call(fake_vllm.__name__, "moved", args=("kv_cache_configs",), optional=True))
    code, finding = _exit_code(forms)
    assert code == EXIT_DRIFT and "extra" in finding.detail, finding
    assert "extra" in calls_problem([forms])
    fake_vllm.moved = lambda kv_cache_configs: None
    assert calls_problem([forms]) is None and _exit_code(forms)[1].detail == ""  # the present one binds
    del fake_vllm.moved
    code, finding = _exit_code(forms)
    assert code == EXIT_UNTESTED and "absent here" in finding.detail, finding  # neither there: not called


class SchedulerConfigBefore:  # no is_encoder_decoder, no async_scheduling field
    def __init__(self, max_num_seqs=128, max_model_len=None, max_num_batched_tokens=None): ...


class SchedulerConfigAsync:
    def __init__(self, max_num_seqs=128, max_model_len=None, max_num_batched_tokens=None, async_scheduling=None): ...


class SchedulerConfigRenamed:  # max_num_seqs renamed: what speculators passes does not bind
    def __init__(self, max_seqs=128, max_model_len=None, max_num_batched_tokens=None): ...


@pytest.mark.parametrize("config", [SchedulerConfigBefore, SchedulerConfigAsync, SchedulerConfigRenamed])
def test_scheduler_config_forms_with_and_without_the_added_fields(fake_vllm, config):
    from speculators_compat.patches import engine_config

    fake_vllm.SchedulerConfig = config
    code, finding = _exit_code(fake_vllm.repoint(engine_config.SCHEDULER_CONFIG_FORMS))
    if config is SchedulerConfigRenamed:
        assert code == EXIT_DRIFT and "max_num_seqs" in finding.detail, finding
    else:
        assert finding.status == "ok" and ("async_scheduling" in finding.name) == (config is SchedulerConfigAsync), finding


def test_driver_call_with_a_new_required_parameter_is_drift(fake_vllm):
    fake_vllm.MultiprocExecutor = ExecutorNewParam
    findings = [_exit_code(fake_vllm.repoint(spec)) for spec in _driver_executor_calls()]
    drift = [f for code, f in findings if code == EXIT_DRIFT]
    assert [f.name.split(".")[-1].split("(")[0] for f in drift] == ["execute_model"], findings
    assert "grammar_output" in drift[0].detail, drift[0]


# -- the calls of the worker capture and of the worker-start cause record


class RMSNormNow:  # vLLM 0.11-0.32
    def forward_native(self, x, residual=None): ...


class RMSNormResidualRequired:  # a release whose native norm requires the residual
    def forward_native(self, x, residual): ...


class StoreNow:  # speculators 0.3.0-0.4.0.1
    def _store_captured_states(self, aux_hidden_states): ...


class StoreNewParam:
    def _store_captured_states(self, aux_hidden_states, positions): ...


@pytest.mark.parametrize("cls, drift", [(RMSNormNow, False), (RMSNormResidualRequired, True)])
def test_the_self_checks_final_norm_call_is_bound(fake_vllm, cls, drift):
    from speculators_compat.patches.worker_capture import RPC_CALLS

    fake_vllm.RMSNorm = cls
    code, finding = _exit_code(fake_vllm.repoint(RPC_CALLS[0]))
    assert (code == EXIT_DRIFT) == drift and ("residual" in finding.detail) == drift, finding


@pytest.mark.parametrize("cls, drift", [(StoreNow, False), (StoreNewParam, True)])
def test_the_hooks_legacy_store_call_is_bound(fake_vllm, cls, drift):
    from speculators_compat.patches.worker_capture import HOOKS_CALLS

    fake_vllm.HiddenStatesWorkerExtension = cls
    code, finding = _exit_code(fake_vllm.repoint(HOOKS_CALLS[0]))
    assert (code == EXIT_DRIFT) == drift, finding


def test_the_cause_records_logger_call_binds_to_vllms_logger_not_a_narrower_one():
    import logging

    from speculators_compat.patches.worker_errors import LOG_CALL

    assert bind_problem(LOG_CALL, logging.getLogger("x").exception) is None

    class Narrow:
        def exception(self, msg): ...

    assert "stacklevel" in bind_problem(LOG_CALL, Narrow().exception)
