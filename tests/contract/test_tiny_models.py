"""Tiny model factory + HF hook reference (speculators_compat_testbed)."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.contract

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

from speculators_compat_testbed import (  # noqa: E402
    ARCHITECTURES,
    TOLERANCE,
    build_tiny_model,
    compare,
    decoder_layers,
    hf_layer_outputs,
    load_hf_model,
    relative_error,
    vllm_engine_kwargs,
    vllm_env,
    vllm_unsupported_reason,
)

SEQUENCES = [[1] + list(range(10, 90)), [1] + list(range(400, 700, 3)) + list(range(4, 40))]


def _digest(directory) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


@pytest.fixture(scope="session")
def model_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_models")


def test_import_does_not_pull_torch():
    code = (
        "import sys, speculators_compat_testbed as t; "
        "assert t.ARCHITECTURES; "
        "bad = [m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules]; "
        "assert not bad, bad"
    )
    env_cmd = [sys.executable, "-c", code]
    import os

    env = dict(os.environ, SPECULATORS_COMPAT_DISABLE="1")
    subprocess.run(env_cmd, check=True, env=env)


def _skip_without_hf_class(arch):
    from speculators_compat_testbed.tiny_models import hf_unsupported_reason

    reason = hf_unsupported_reason(arch)
    if reason:
        pytest.skip(reason)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_build_is_deterministic_and_cached(arch, tmp_path):
    _skip_without_hf_class(arch)
    a = build_tiny_model(arch, tmp_path / "a")
    b = build_tiny_model(arch, tmp_path / "b")
    assert a.name == b.name
    da, db = _digest(a), _digest(b)
    assert "model.safetensors" in da and "config.json" in da and "tokenizer.json" in da
    assert da == db
    # Reuse: a second call returns the same directory without rewriting it.
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(arch, tmp_path / "a") == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
    # Overrides change the cache key.
    c = build_tiny_model(arch, tmp_path / "a", overrides={"rms_norm_eps": 1e-5})
    assert c != a


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_hook_reference_matches_output_hidden_states(arch, model_root):
    _skip_without_hf_class(arch)
    d = build_tiny_model(arch, model_root)
    model = load_hf_model(d, "float32")
    cfg = getattr(model.config, "text_config", None) or model.config  # multimodal: the text decoder's
    assert cfg.max_position_embeddings >= 4096
    assert 1000 <= cfg.vocab_size <= 2000
    n = len(decoder_layers(model))
    assert 2 <= n <= 4
    layer_ids = list(range(n))
    ref = hf_layer_outputs(model, SEQUENCES, layer_ids, "float32")
    assert len(ref) == len(SEQUENCES)
    for s, seq in enumerate(SEQUENCES):
        with torch.no_grad():
            hs = model(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states
        assert len(hs) == n + 1
        for k in range(n):
            assert ref[s][k].shape == (len(seq), cfg.hidden_size)
            assert ref[s][k].dtype == torch.float32
        for k in range(n - 1):
            assert relative_error(ref[s][k], hs[k + 1][0]) < 1e-6
        # Last layer: hooks give the residual stream, output_hidden_states the final-normed one.
        assert relative_error(ref[s][n - 1], hs[n][0]) > 1e-2
        # The residual stream is not ~0 and every layer changes it.
        for k in range(n):
            assert ref[s][k].float().pow(2).mean().sqrt() > 0.05
            assert relative_error(ref[s][k], hs[k][0]) > 0.1
    rep = compare(ref, ref, "float32")
    assert rep.passed and rep.max_error == 0.0


def test_tokenizer_round_trip(model_root):
    tok = transformers.AutoTokenizer.from_pretrained(str(build_tiny_model("llama", model_root)))
    ids = tok("hello world the quick brown fox")["input_ids"]
    assert ids[0] == tok.bos_token_id == 1
    assert tok.eos_token_id == 2
    assert tok.decode(ids, skip_special_tokens=True) == "hello world the quick brown fox"
    assert len(tok) == 1024


def test_llava_is_a_multimodal_wrapper(model_root):
    """llava: a CLIP tower + projector around a Llama decoder; <image> is the last id (the e2e
    runner's random prompts stay below 1000); the processor vLLM profiles with loads."""
    import json

    d = build_tiny_model("llava", model_root)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["LlavaForConditionalGeneration"]
    assert cfg["text_config"]["model_type"] == "llama" and cfg["image_token_index"] == 1023
    assert cfg["vision_config"]["image_size"] // cfg["vision_config"]["patch_size"] == 2
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    assert len(tok) == 1024 and tok.convert_tokens_to_ids("<image>") == 1023
    processor = transformers.AutoProcessor.from_pretrained(str(d))
    assert type(processor).__name__ == "LlavaProcessor"
    # the text-only tokenizer of the other archs is unchanged by the image token
    plain = transformers.AutoTokenizer.from_pretrained(str(build_tiny_model("llama", model_root)))
    assert "<image>" not in plain.get_vocab()


def test_deepseek_routing_knobs(model_root):
    import json

    d = build_tiny_model("deepseek_v3", model_root)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["topk_method"] == "noaux_tc" and cfg["scoring_func"] == "sigmoid"
    assert cfg["first_k_dense_replace"] == 1 and cfg["n_routed_experts"] % cfg["n_group"] == 0
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        keys = [k for k in f.keys() if k.endswith("e_score_correction_bias")]
        assert keys
        assert all(f.get_tensor(k).abs().max() > 0 for k in keys)


def test_compare_report():
    a = torch.ones(5, 8)
    rep = compare([[a, a]], [[a, a * 1.01]], "bfloat16")
    assert rep.passed and 0 < rep.max_error < TOLERANCE["bfloat16"]
    rep = compare([[a, a]], [[a, a * 1.01]], torch.float32)
    assert not rep.passed and rep.failures() == [(0, 1, pytest.approx(1 / 101, rel=1e-4))]
    # A stacked [len, n_layers, hidden] capture is split along the layer axis.
    rep = compare([torch.stack([a, a], 1)], [[a, a]], "float32")
    assert rep.passed
    rep = compare([[a[:4]]], [[a]], "float32")
    assert not rep.passed and rep.problems
    # One token far off (an MoE routing flip, a misplaced row): fails, whatever the share of tokens.
    b = torch.randn(100, 8)
    c = b.clone()
    c[7] += 10
    rep = compare([[c]], [[b]], "float32")
    assert not rep.passed and rep.rows_over == [[1]] and rep.worst_row["row"] == 7
    assert "max_error" in rep.as_dict() and "FAIL" in rep.summary()


def test_vllm_knobs_are_data():
    assert vllm_engine_kwargs("deepseek_v3", "cpu")["compilation_config"] == {
        "custom_ops": ["-rotary_embedding"]
    }
    assert vllm_env("deepseek_v3", "cpu")["VLLM_MLA_DISABLE"] == "1"
    assert vllm_env("llama", "cpu")["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert "VLLM_MLA_DISABLE" not in vllm_env("deepseek_v3", "cuda")
    assert vllm_unsupported_reason("gpt_oss", "0.16.0", "cpu", "float32")
    assert vllm_unsupported_reason("gpt_oss", "0.16.0", "cpu", "bfloat16") is None
    assert vllm_unsupported_reason("gpt_oss", "0.32.0", "cpu", "float32") is None
    assert vllm_unsupported_reason("gpt_oss", "0.16.0", "cuda", "float32") is None
    assert vllm_unsupported_reason("llama", "0.16.0") is None
    for arch in ("qwen3_next", "qwen3_5"):  # no release yet: a version, not a tuple (InvalidVersion before)
        assert vllm_unsupported_reason(arch, "0.16.0", "cpu", "float32")
        assert vllm_unsupported_reason(arch, "0.32.0", "cpu", "bfloat16") is None


def test_the_rehearsal_reads_the_installed_vllm_cpu_release():
    """``vllm-cpu`` is the distribution on CPU: the rehearsal must find its release (it asked for
    float32 where this engine refuses it when it looked up ``vllm`` only)."""
    from speculators_compat_testbed import rehearsal
    from speculators_compat.versions import installed_versions

    found = installed_versions()["vllm"]
    assert rehearsal._engine_refuses("qwen3_next", "float32")
    expected = vllm_unsupported_reason("gpt_oss", found.version, "cpu", "float32") is not None
    assert rehearsal._engine_refuses("gpt_oss", "float32") is expected


def test_mistral_runs_a_sliding_window_unlike_llama(model_root):
    """Mistral's window is shorter than the e2e runner's long sequences: on the same seeded
    weights it equals Llama before the window fills and differs after (its cells are not copies
    of Llama's)."""
    import json

    from speculators_compat_testbed.tiny_models import MISTRAL_SLIDING_WINDOW

    d = build_tiny_model("mistral", model_root)
    assert json.loads((d / "config.json").read_text())["sliding_window"] == MISTRAL_SLIDING_WINDOW < 300
    seq = [[(7 * i) % 997 + 3 for i in range(2 * MISTRAL_SLIDING_WINDOW)]]
    mis = hf_layer_outputs(d, seq, [3])[0][0]
    # llama at mistral's head size (32; llama's own is 64): the same seeded weights by name
    same_shape = {"head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 2}
    lla = hf_layer_outputs(build_tiny_model("llama", model_root, overrides=same_shape), seq, [3])[0][0]
    w = MISTRAL_SLIDING_WINDOW
    assert relative_error(mis[: w - 8], lla[: w - 8]) < 1e-5
    assert relative_error(mis[w + 8:], lla[w + 8:]) > 1e-2


def test_kimi_k25_is_laid_out_as_released(model_root):
    """kimi_k25: the released Kimi-K2.5 layout (wrapper config, DeepSeek-V3 text_config, MoonViT
    tower + patch-merger projector under their released names, remote config + image processor);
    the layer count speculators' generator reads (AutoConfig(trust_remote_code=True), then
    ``num_hidden_layers`` or ``text_config.num_hidden_layers``) is the text decoder's, never the
    vision tower's."""
    import json

    from safetensors import safe_open

    d = build_tiny_model("kimi_k25", model_root)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"] and cfg["model_type"] == "kimi_k25"
    text, vision = cfg["text_config"], cfg["vision_config"]
    assert text["model_type"] == "deepseek_v3" and text["topk_method"] == "noaux_tc" and text["scoring_func"] == "sigmoid"
    assert text["n_routed_experts"] % text["n_group"] == 0 and 1 < text["topk_group"] < text["n_group"]
    assert text["first_k_dense_replace"] == 1 and text["n_shared_experts"] == 1
    assert (text["kv_lora_rank"], text["qk_rope_head_dim"], text["qk_nope_head_dim"], text["v_head_dim"]) == (256, 64, 128, 128)
    assert vision["num_hidden_layers"] != text["num_hidden_layers"]  # a wrong-tower read would show
    assert cfg["media_placeholder_token_id"] == cfg["image_token_id"] == 1023
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "language_model.lm_head.weight" in keys and "language_model.model.embed_tokens.weight" in keys
    assert "mm_projector.proj.0.weight" in keys and "vision_tower.encoder.blocks.0.wqkv.weight" in keys
    assert any(k.endswith("mlp.gate.e_score_correction_bias") for k in keys)
    assert any(".mlp.shared_experts." in k for k in keys) and "language_model.model.layers.0.mlp.gate_proj.weight" in keys
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    assert len(tok) == 1024 and tok.convert_tokens_to_ids("<|media_pad|>") == 1023
    auto = transformers.AutoConfig.from_pretrained(str(d), trust_remote_code=True)
    n = getattr(auto, "num_hidden_layers", None) or auto.text_config.num_hidden_layers
    assert n == text["num_hidden_layers"] == 4
    # overrides reach the decoder (llama_4_scaling, MLA dims are read from text_config)
    l4s = {"original_max_position_embeddings": 256, "beta": 0.1}
    d2 = build_tiny_model("kimi_k25", model_root, overrides={"llama_4_scaling": l4s})
    assert json.loads((d2 / "config.json").read_text())["text_config"]["llama_4_scaling"] == l4s
