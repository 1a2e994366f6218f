"""check: how a failed import of speculators' generator/worker module is classified."""

from __future__ import annotations

import pytest

from speculators_compat.check import _import_finding

pytestmark = pytest.mark.unit

GEN = "speculators.data_generation.vllm_hidden_states_generator"


def _raised(exc):
    try:
        raise exc
    except Exception as caught:  # noqa: BLE001
        return _import_finding(GEN, caught)


def test_a_vllm_name_gone_is_drift():
    f = _raised(ImportError("cannot import name 'x' from 'vllm.v1.core.kv_cache_utils'", name="vllm.v1.core.kv_cache_utils"))
    assert (f.kind, f.name, f.status) == ("import", GEN, "drift")
    assert "cannot import name 'x'" in f.detail and "Traceback" in f.detail


def test_a_vllm_module_gone_is_drift():
    assert _raised(ModuleNotFoundError("No module named 'vllm.utils.hashing'", name="vllm.utils.hashing")).status == "drift"


@pytest.mark.parametrize(
    "exc",
    [
        ModuleNotFoundError("No module named 'transformers.modeling_attn_mask_utils'", name="transformers.modeling_attn_mask_utils"),
        ImportError("something without a module name"),
        NameError("name 'torch' is not defined"),
        ModuleNotFoundError("No module named 'vllmx'", name="vllmx"),
    ],
)
def test_anything_else_cannot_be_checked(exc):
    assert _raised(exc).status == "error"
