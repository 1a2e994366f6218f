"""The HF reference loads a multimodal wrapper checkpoint as transformers defines it, even where
vLLM has registered its own config class for that model_type.

vLLM registers its own ``KimiK25Config`` under ``kimi_k25`` in transformers' ``CONFIG_MAPPING``;
transformers 5 has its own ``Kimi_K25Config`` and ``Kimi_K25ForConditionalGeneration``, and its
Auto classes refuse the foreign config ("Unrecognized configuration class ... KimiK25Config"): the
Kimi-K2.5 cells on the H200 (benchmarks/results/gpu/logs/, src tree ad638b9) died loading HF after
the engine had run. The reference now loads with transformers' own classes there.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.contract

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_a_foreign_config_registration_does_not_stop_the_reference(monkeypatch):
    from transformers import CONFIG_MAPPING, PretrainedConfig

    from speculators_compat_testbed import build_tiny_model
    from speculators_compat_testbed.reference import _transformers_classes, decoder_layers, load_hf_model

    # transformers 5: its Kimi_K25ForConditionalGeneration; 4.57: no Kimi class, the text decoder
    # (DeepSeek-V3 on the language_model.* tensors). Either way the same model as without vLLM's config.
    want = "Kimi_K25ForConditionalGeneration" if _transformers_classes("kimi_k25") else "DeepseekV3ForCausalLM"
    model_dir = build_tiny_model("kimi_k25")
    own = load_hf_model(model_dir)
    assert type(own).__name__ == want

    class KimiK25Config(PretrainedConfig):  # as vLLM's: another class under the same model_type
        model_type = "kimi_k25"

    monkeypatch.setitem(CONFIG_MAPPING._extra_content, "kimi_k25", KimiK25Config)
    assert CONFIG_MAPPING["kimi_k25"] is KimiK25Config
    with pytest.raises(ValueError, match="Unrecognized configuration class"):
        transformers.AutoModelForImageTextToText.from_pretrained(str(model_dir))
    loaded = load_hf_model(model_dir)
    assert type(loaded) is type(own)
    assert len(decoder_layers(loaded)) == len(decoder_layers(own))
    a, b = own.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
