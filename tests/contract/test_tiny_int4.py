"""Kimi-K2.5 INT4 as released, built by the tiny model factory (needs torch + compressed-tensors).

Layout: the released ``quantization_config`` in ``text_config``; every routed expert's Linear
as ``weight_packed`` (int32, 8 nibbles a word) + ``weight_scale`` (one per 32 inputs, the
checkpoint dtype) + ``weight_shape``; every ignored module (attention, shared experts, the dense
first layer, lm_head, vision tower, projector) unpacked, bit-identical to the unquantized build.
Dequantized (compressed-tensors' own unpack, ``q * scale``) the experts come back close to the
unquantized weights and equal to the ``dequantized/`` copy HF loads."""

from __future__ import annotations

import json
import re

import pytest

pytestmark = pytest.mark.contract

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("compressed_tensors")

from safetensors.torch import load_file  # noqa: E402

from speculators_compat_testbed import tiny_models as tm  # noqa: E402


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_int4")
    q = tm.build_tiny_model("kimi_k25", root, quantization="w4a16")
    plain = tm.build_tiny_model("kimi_k25", root)
    return q, plain


def test_distinct_cache_entries(built):
    q, plain = built
    assert q != plain and "-w4a16-" in q.name
    assert tm.hf_reference_dir(q) == q / "dequantized" and tm.hf_reference_dir(plain) == plain


def test_config_carries_the_released_block(built):
    q, _ = built
    cfg = json.loads((q / "config.json").read_text())
    assert "quantization_config" not in cfg  # the released checkpoint has it in text_config
    assert cfg["text_config"]["quantization_config"] == tm.KIMI_K25_W4A16_QUANTIZATION_CONFIG
    deq = json.loads((q / "dequantized" / "config.json").read_text())
    assert "quantization_config" not in deq["text_config"]


def test_packed_names_shapes_and_ignored_modules(built):
    q, plain = built
    packed = load_file(str(q / "model.safetensors"))
    ref = load_file(str(plain / "model.safetensors"))
    experts = tm.quantized_weight_names(ref)
    cfg = json.loads((plain / "config.json").read_text())["text_config"]
    n_moe_layers = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    assert len(experts) == n_moe_layers * cfg["n_routed_experts"] * 3
    for name in experts:
        base = name[: -len(".weight")]
        out_f, in_f = ref[name].shape
        assert name not in packed
        assert packed[base + ".weight_packed"].dtype == torch.int32
        assert tuple(packed[base + ".weight_packed"].shape) == (out_f, in_f // 8)
        assert tuple(packed[base + ".weight_scale"].shape) == (out_f, in_f // 32)
        assert packed[base + ".weight_scale"].dtype == ref[name].dtype
        assert packed[base + ".weight_shape"].tolist() == [out_f, in_f]
        assert base + ".weight_zero_point" not in packed  # symmetric: no zero point stored
    others = set(ref) - set(experts)
    assert {k for k in packed if not re.search(r"\.weight_(packed|scale|shape)$", k)} == others
    for name in others:  # attention, shared experts, dense MLP, router, norms, lm_head, vision, projector
        assert torch.equal(packed[name], ref[name]), name
        if name.endswith(".weight") and ref[name].dim() == 2 and "embed_tokens" not in name and ".mlp.gate." not in name:
            assert tm.quantization_ignored(name[: -len(".weight")]), name  # every other Linear is ignored


def test_dequantizes_back_close_to_the_unquantized_weights(built):
    from compressed_tensors.compressors import unpack_from_int32

    q, plain = built
    packed = load_file(str(q / "model.safetensors"))
    ref = load_file(str(plain / "model.safetensors"))
    deq_copy = load_file(str(q / "dequantized" / "model.safetensors"))
    assert set(deq_copy) == set(ref)
    worst = 0.0
    for name in tm.quantized_weight_names(ref):
        base = name[: -len(".weight")]
        shape = torch.Size(packed[base + ".weight_shape"].tolist())
        ints = unpack_from_int32(packed[base + ".weight_packed"], 4, shape)
        assert int(ints.min()) >= -8 and int(ints.max()) <= 7
        scale = packed[base + ".weight_scale"].float()
        deq = ints.float() * scale.repeat_interleave(32, dim=1)
        assert torch.equal(deq.to(deq_copy[name].dtype), deq_copy[name]), name
        w = ref[name].float()
        rel = float((deq - w).norm() / w.norm())
        worst = max(worst, rel)
        # symmetric int4, group 32, minmax: each entry within half a step of its group's scale
        assert float(((deq - w).abs() - scale.repeat_interleave(32, dim=1) / 2).max()) <= 1e-6, name
    assert 0.0 < worst < 0.15


def test_hf_loads_the_dequantized_copy(built):
    """HF's reference for the INT4 cells: the dequantized copy loads (every tensor used) and runs;
    its layers differ from the unquantized model's (the int4 rounding), by a bounded amount."""
    from speculators_compat_testbed.reference import hf_layer_outputs, load_hf_model, relative_error

    q, plain = built
    seqs = [[1] + list(range(10, 60))]
    got = hf_layer_outputs(load_hf_model(tm.hf_reference_dir(q)), seqs, [1, 3])
    ref = hf_layer_outputs(load_hf_model(plain), seqs, [1, 3])
    for g, r in zip(got[0], ref[0]):
        assert torch.isfinite(g).all()
        assert 0.0 < relative_error(g, r) < 0.5
