"""cpu-rms-norm-native: the probe's reading of vLLM's RMSNorm dispatch, the custom-op edit, the
wrapper, and the shipped matrix range (no vLLM needed: the objects below copy the shape of
vLLM's own code at each version)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from _helpers import SHIPPED_MATRIX

from speculators_compat.matrix import load_matrix
from speculators_compat.patches import engine_options
from speculators_compat.patches.engine_options import cpu_rms_norm_reaches_strided_kernel, disable_rms_norm_op


class _CustomOpDelegatingToCuda:  # vLLM 0.11-0.13 CustomOp.forward_cpu
    def forward_native(self, *args, **kwargs):
        return "native"

    def forward_cuda(self, *args, **kwargs):
        return "kernel"

    def forward_cpu(self, *args, **kwargs):
        return self.forward_cuda(*args, **kwargs)


class _CustomOpNative(_CustomOpDelegatingToCuda):  # vLLM 0.14+ CustomOp.forward_cpu
    def forward_cpu(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)


class _RMSNormOld(_CustomOpDelegatingToCuda):
    name = "rms_norm"


class _RMSNormNew(_CustomOpNative):
    name = "rms_norm"


def _kernel(out, input, weight, epsilon):  # noqa: A002 - vLLM's parameter name
    pass


def _ops_rms_norm_strided(out, input, weight, epsilon):  # noqa: A002 - vLLM 0.12-0.13
    _kernel(out, input, weight, epsilon)


def _ops_rms_norm_contiguous(out, input, weight, epsilon):  # noqa: A002 - vLLM 0.11
    input_contiguous = input.contiguous()
    _kernel(out, input_contiguous, weight, epsilon)


def test_probe_reading_needs_the_patch_where_cpu_reaches_the_strided_kernel():
    assert cpu_rms_norm_reaches_strided_kernel(_RMSNormOld, _ops_rms_norm_strided) is None


def test_probe_reading_not_needed_where_the_wrapper_makes_input_contiguous():
    reason = cpu_rms_norm_reaches_strided_kernel(_RMSNormOld, _ops_rms_norm_contiguous)
    assert reason and "contiguous" in reason


def test_probe_reading_not_needed_where_cpu_runs_forward_native():
    reason = cpu_rms_norm_reaches_strided_kernel(_RMSNormNew, _ops_rms_norm_strided)
    assert reason and "forward_native" in reason


def test_disable_rms_norm_op_adds_once_and_respects_an_explicit_plus():
    ops = ["-rotary_embedding", "all"]
    assert disable_rms_norm_op(ops) is True
    assert ops == ["-rotary_embedding", "all", "-rms_norm"]
    assert disable_rms_norm_op(ops) is False
    assert ops.count("-rms_norm") == 1
    explicit = ["+rms_norm", "all"]
    assert disable_rms_norm_op(explicit) is False
    assert explicit == ["+rms_norm", "all"]  # never both (vLLM asserts on "+x" with "-x")


@pytest.mark.parametrize("on_cpu, expected", [(True, ["all", "-rms_norm"]), (False, ["all"])])
def test_wrapper_edits_the_built_config_on_cpu_only(monkeypatch, on_cpu, expected):
    monkeypatch.setattr(engine_options, "on_cpu", lambda: on_cpu)
    built = SimpleNamespace(compilation_config=SimpleNamespace(custom_ops=["all"]))
    seen = {}

    def create(model_path, max_model_len, **kw):
        seen.update(model_path=model_path, max_model_len=max_model_len, **kw)
        return built

    out = engine_options._native_rms_norm_on_cpu(create, None, ("m",), {"max_model_len": 8, "tensor_parallel_size": 1})
    assert out is built
    assert seen == {"model_path": "m", "max_model_len": 8, "tensor_parallel_size": 1}
    assert built.compilation_config.custom_ops == expected


@pytest.mark.parametrize(
    "vllm, applies",
    [("0.11.2", False), ("0.12.0", True), ("0.12.0.post2", True), ("0.13.0", True), ("0.14.0", False), ("0.32.0", False)],
)
def test_shipped_range(vllm, applies):
    patch = load_matrix(SHIPPED_MATRIX).patches["cpu-rms-norm-native"]
    assert (patch.gate({"speculators": "0.4.0.1", "vllm": vllm}) is None) is applies


# --- the sliding-window rule read off create_engine_config's code, in the shapes vLLM wrote it


def _rule_interleaved(self, text_config):  # vLLM 0.11-0.26
    from vllm.transformers_utils.config import is_interleaved  # noqa: F401 - only its name matters

    return None if is_interleaved(text_config) else 1


def _rule_getattr(self, text_config):  # vLLM 0.29-0.33
    layer_types = getattr(text_config, "layer_types", None)
    return layer_types is None or all(t == "sliding_attention" for t in layer_types)


def _rule_attribute_and_tuple(self, text_config):  # a refactor: attribute access, the name in a tuple
    return text_config.layer_types is None or all(t in ("sliding_attention",) for t in text_config.layer_types)


def _rule_neither(self, text_config):
    return text_config.sliding_window


@pytest.mark.parametrize(
    ("fn", "rule"),
    [(_rule_interleaved, "not-interleaved"), (_rule_getattr, "all-sliding-layer-types"),
     (_rule_attribute_and_tuple, "all-sliding-layer-types"), (_rule_neither, None)],
)
def test_sliding_window_rule_reads_each_shape(fn, rule):
    assert engine_options.sliding_window_rule(fn) == rule


def test_code_constants_include_tuple_and_frozenset_members():
    def f(x):
        return x in ("alpha", "beta") or x in {"gamma", "delta"} or [y for y in x if y == "eps"]

    assert {"alpha", "beta", "gamma", "delta", "eps"} <= engine_options._code_constants(f)
    assert "x" not in engine_options._code_constants(f)
