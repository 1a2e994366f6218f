"""Kimi-K2.5 INT4 as released: the quantization_config block and its ignore list (no torch needed).

The built checkpoint (packed names, shapes, dequantization) is checked in
tests/contract/test_tiny_int4.py, which needs torch and compressed-tensors."""

from __future__ import annotations

import pytest

from speculators_compat_testbed import tiny_models as tm

QC = tm.KIMI_K25_W4A16_QUANTIZATION_CONFIG


def test_quantization_config_has_the_released_keys():
    assert set(QC) == {"config_groups", "format", "ignore", "kv_cache_scheme", "quant_method", "quantization_status"}
    assert QC["quant_method"] == "compressed-tensors"
    assert QC["format"] == "pack-quantized"
    assert QC["quantization_status"] == "compressed"
    assert QC["kv_cache_scheme"] is None
    (group,) = QC["config_groups"].values()
    assert group["targets"] == ["Linear"]
    assert group["input_activations"] is None and group["output_activations"] is None  # W4A16
    w = group["weights"]
    assert (w["type"], w["num_bits"], w["symmetric"], w["strategy"], w["group_size"]) == ("int", 4, True, "group", 32)
    assert w["dynamic"] is False and w["actorder"] is None and w["observer"] == "minmax"


@pytest.mark.parametrize(
    "module",
    [
        "language_model.model.layers.1.self_attn.q_a_proj",
        "language_model.model.layers.1.self_attn.kv_b_proj",
        "language_model.model.layers.1.self_attn.o_proj",
        "language_model.model.layers.1.mlp.shared_experts.gate_proj",
        "language_model.model.layers.3.mlp.shared_experts.down_proj",
        "language_model.model.layers.0.mlp.gate_proj",  # the dense first layer
        "language_model.model.layers.0.mlp.down_proj",
        "language_model.lm_head",
        "vision_tower.encoder.blocks.0.wqkv",
        "vision_tower.encoder.blocks.1.mlp.fc0",
        "mm_projector.proj.0",
        "mm_projector.proj.2",
    ],
)
def test_ignore_list_keeps_attention_shared_dense_head_and_vision(module):
    assert tm.quantization_ignored(module)


@pytest.mark.parametrize(
    "module",
    [
        "language_model.model.layers.1.mlp.experts.0.gate_proj",
        "language_model.model.layers.1.mlp.experts.7.up_proj",
        "language_model.model.layers.3.mlp.experts.5.down_proj",
    ],
)
def test_routed_experts_are_not_ignored(module):
    assert not tm.quantization_ignored(module)


def test_quantized_weight_names_are_the_routed_experts_only():
    names = [
        "language_model.model.layers.0.mlp.gate_proj.weight",
        "language_model.model.layers.1.mlp.gate.weight",  # the router: not a Linear that is packed
        "language_model.model.layers.1.mlp.shared_experts.up_proj.weight",
        "language_model.model.layers.1.mlp.experts.3.down_proj.weight",
        "language_model.model.layers.1.mlp.experts.3.gate_proj.weight",
        "language_model.model.layers.1.self_attn.q_b_proj.weight",
        "language_model.lm_head.weight",
        "vision_tower.encoder.blocks.0.wo.weight",
    ]
    assert tm.quantized_weight_names(names) == [
        "language_model.model.layers.1.mlp.experts.3.down_proj.weight",
        "language_model.model.layers.1.mlp.experts.3.gate_proj.weight",
    ]


def test_quantization_is_kimi_only_and_keyed_apart():
    with pytest.raises(ValueError):
        tm.build_tiny_model("llama", "/nonexistent", quantization="w4a16")
    with pytest.raises(ValueError):
        tm.build_tiny_model("kimi_k25", "/nonexistent", quantization="w8a8")
    plain = tm._cache_key("kimi_k25", 4, 128, "float32", {})
    assert plain == tm._cache_key("kimi_k25", 4, 128, "float32", {}, None)  # existing cache entries stay valid
    assert tm._cache_key("kimi_k25", 4, 128, "float32", {}, "w4a16") != plain
