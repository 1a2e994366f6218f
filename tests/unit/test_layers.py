"""layers.py on fake decoder-layer classes (no torch: tensors are objects with a ``.shape``)."""

from __future__ import annotations

import logging

import pytest

from speculators_compat.layers import (
    ADAPTERS,
    UnknownLayerError,
    adapter_for,
    find_decoder_stack,
)

pytestmark = pytest.mark.unit


class T:
    """A stand-in tensor: a shape and elementwise addition of a tag."""

    def __init__(self, shape, tag="t"):
        self.shape = tuple(shape)
        self.tag = tag

    def __add__(self, other):
        assert self.shape == other.shape
        return T(self.shape, f"{self.tag}+{other.tag}")


def _layer_class(name: str, forward):
    return type(name, (), {"forward": forward, "__module__": "fake_models"})


def _fused(self, positions, hidden_states, residual):
    return hidden_states, residual


def _other(self, x, attention_mask=None):
    return x


# -- adapter_for -------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_known_class_with_the_right_signature(name):
    adapter = adapter_for(_layer_class(name, _fused))
    assert adapter is ADAPTERS[name]
    assert adapter.name == "fused-residual"


def test_known_class_with_the_wrong_signature_is_an_error():
    cls = _layer_class("LlamaDecoderLayer", _other)
    with pytest.raises(UnknownLayerError) as info:
        adapter_for(cls)
    msg = str(info.value)
    assert msg.startswith("fake_models.LlamaDecoderLayer.forward(self, x, attention_mask=None): ")
    assert "adapter fused-residual expects parameters hidden_states, residual; missing hidden_states, residual" in msg


def test_unknown_class_with_fused_residual_signature(caplog):
    cls = _layer_class("BrandNewDecoderLayer", _fused)
    with caplog.at_level(logging.INFO, logger="speculators_compat"):
        adapter = adapter_for(cls)
    assert adapter.name == "fused-residual"
    assert adapter is ADAPTERS["LlamaDecoderLayer"]
    assert any("BrandNewDecoderLayer is not in the adapter table" in r.getMessage() for r in caplog.records)


def test_unknown_class_with_keyword_only_fused_signature():
    def forward(self, *, positions, hidden_states, residual, **kwargs):
        return hidden_states, residual

    assert adapter_for(_layer_class("KwOnlyLayer", forward)).name == "fused-residual"


def test_unknown_class_with_another_signature_is_an_error():
    cls = _layer_class("WeirdBlock", _other)
    with pytest.raises(UnknownLayerError) as info:
        adapter_for(cls)
    msg = str(info.value)
    assert msg.startswith("no decoder-layer adapter for fake_models.WeirdBlock.forward(self, x, attention_mask=None): ")
    assert "LlamaDecoderLayer" in msg  # lists the known classes
    assert "forward(..., hidden_states, residual)" in msg


def test_class_without_forward_is_an_error():
    cls = type("NoForward", (), {})
    with pytest.raises(UnknownLayerError, match=r"^no decoder-layer adapter for NoForward \(no readable forward\)"):
        adapter_for(cls)


def test_unknown_layer_error_is_a_type_error():
    assert issubclass(UnknownLayerError, TypeError)


# -- residual stream and output check ----------------------------------------------------


def test_residual_stream_adds_the_residual():
    adapter = ADAPTERS["LlamaDecoderLayer"]
    h, r = T((4, 8), "h"), T((4, 8), "r")
    assert adapter.residual_stream((h, r)).tag == "h+r"
    assert adapter.residual_stream((h, None)) is h


def test_check_output_accepts_a_pair_of_equal_shapes():
    adapter = ADAPTERS["LlamaDecoderLayer"]
    cls = _layer_class("LlamaDecoderLayer", _fused)
    assert adapter.check_output(cls, (T((4, 8)), T((4, 8)))) is None
    assert adapter.check_output(cls, (T((4, 8)), None)) is None


def test_check_output_rejects_a_single_tensor():
    adapter = ADAPTERS["LlamaDecoderLayer"]
    cls = _layer_class("LlamaDecoderLayer", _fused)
    with pytest.raises(UnknownLayerError) as info:
        adapter.check_output(cls, T((4, 8)))
    assert str(info.value) == (
        "LlamaDecoderLayer (adapter fused-residual): expected the layer to return "
        "(hidden_states, residual) of equal shapes; found T"
    )


def test_check_output_rejects_a_triple_and_names_shapes():
    adapter = ADAPTERS["LlamaDecoderLayer"]
    cls = _layer_class("LlamaDecoderLayer", _fused)
    with pytest.raises(UnknownLayerError) as info:
        adapter.check_output(cls, (T((4, 8)), T((4, 8)), T((2,))))
    assert str(info.value).endswith("found tuple(T(4, 8), T(4, 8), T(2,))")


def test_check_output_rejects_mismatched_shapes():
    adapter = ADAPTERS["LlamaDecoderLayer"]
    cls = _layer_class("LlamaDecoderLayer", _fused)
    with pytest.raises(UnknownLayerError) as info:
        adapter.check_output(cls, (T((4, 8)), T((4, 16))))
    assert str(info.value).endswith("of equal shapes; found tuple(T(4, 8), T(4, 16))")


def test_check_output_rejects_non_tensors():
    adapter = ADAPTERS["LlamaDecoderLayer"]
    cls = _layer_class("LlamaDecoderLayer", _fused)
    with pytest.raises(UnknownLayerError, match=r"found tuple\(str\(\), str\(\)\)$"):
        adapter.check_output(cls, ("a", "b"))


# -- find_decoder_stack ------------------------------------------------------------------


class Obj:
    def __init__(self, **attrs):
        self.__dict__.update(attrs)


def test_finds_model_layers():
    layers = ["l0", "l1"]
    inner = Obj(layers=layers)
    found_inner, found_layers = find_decoder_stack(Obj(model=inner))
    assert found_inner is inner and found_layers is layers


def test_finds_language_model_through_get_language_model():
    layers = ["l0", "l1", "l2"]
    inner = Obj(layers=layers)
    lm = Obj(model=inner)

    class Wrapper:
        vision_tower = object()

        def get_language_model(self):
            return lm

    found_inner, found_layers = find_decoder_stack(Wrapper())
    assert found_inner is inner and found_layers is layers


def test_finds_language_model_attribute():
    inner = Obj(layers=["l0"])
    found_inner, _ = find_decoder_stack(Obj(language_model=Obj(model=inner)))
    assert found_inner is inner


def test_get_language_model_that_raises_falls_back_to_model():
    inner = Obj(layers=["l0"])

    class Wrapper:
        model = inner

        def get_language_model(self):
            raise NotImplementedError("text-only")

    assert find_decoder_stack(Wrapper())[0] is inner


def test_layers_on_the_model_itself():
    model = Obj(layers=["l0"])
    assert find_decoder_stack(model) == (model, ["l0"])


def test_no_decoder_stack_is_a_clear_error():
    class Headless:
        def __init__(self):
            self.lm_head = object()
            self.model = Obj(blocks=["b0"])

    with pytest.raises(UnknownLayerError) as info:
        find_decoder_stack(Headless())
    msg = str(info.value)
    assert msg.startswith("cannot find the decoder layers of ")
    assert "Headless" in msg
    assert "expected .model.layers (or get_language_model().model.layers)" in msg
    assert msg.endswith("attributes found: lm_head, model")


def test_layers_without_len_are_not_taken():
    with pytest.raises(UnknownLayerError):
        find_decoder_stack(Obj(model=Obj(layers=object())))


def test_language_model_wins_over_a_model_attribute_holding_another_stack():
    """vLLM 0.32's LlavaForConditionalGeneration layout (the e2e llava cell): the wrapper holds a
    vision tower with its own encoder layers, and get_language_model() returns the text CausalLM.
    A wrapper whose ``.model`` is some other stack (speculators 0.3.0 takes ``model.model``)
    must still resolve to the text decoder."""
    text_layers = ["t0", "t1", "t2", "t3"]
    text_model = Obj(layers=text_layers)
    vision = Obj(vision_model=Obj(encoder=Obj(layers=["v0"])))

    class Llava:
        vision_tower = vision
        language_model = Obj(model=text_model)
        model = Obj(layers=["v0"])  # a decoy that taking `model.model` would capture

        def get_language_model(self):
            return self.language_model

    inner, layers = find_decoder_stack(Llava())
    assert inner is text_model and layers is text_layers
