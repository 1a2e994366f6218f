"""Tiny, deterministic, random-weight checkpoints for tests and demos.

No model hub is needed: every model is built from a config written here, weights are
initialised from a fixed seed (per parameter name, so the values do not depend on the order
in which transformers creates modules), and a small BPE tokenizer is trained on an in-code
corpus.  Built models are cached on disk; see :func:`build_tiny_model`.

torch / transformers / tokenizers are imported lazily inside functions so that importing this
module stays cheap.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import zlib
from pathlib import Path
from typing import Any

__all__ = [
    "ARCHITECTURES",
    "FACTORY_VERSION",
    "MASSIVE_ARCHITECTURES",
    "MOE_ARCHITECTURES",
    "MULTIMODAL_ARCHITECTURES",
    "VOCAB_SIZE",
    "build_tiny_model",
    "default_cache_root",
    "tiny_config_kwargs",
    "vllm_engine_kwargs",
    "vllm_env",
    "vllm_unsupported_reason",
]

ARCHITECTURES: tuple[str, ...] = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "deepseek_v3",
    "gpt_oss",
    "mistral",
    "gemma3",
    "llava",
    "kimi_k25",
    "qwen3_5",
    "qwen3_next",
)

# Hybrid-attention archs: gated delta-net linear attention layers (vLLM: MambaSpec KV-cache specs,
# a recurrent state per request) between full-attention layers (FullAttentionSpec).
HYBRID_ARCHITECTURES: tuple[str, ...] = ("qwen3_5", "qwen3_next")

# Multimodal wrappers (a vision tower + projector around a text decoder). Prompts are text-only
# token ids (what speculators feeds), so the captured layers are the text decoder's.
MULTIMODAL_ARCHITECTURES: tuple[str, ...] = ("llava", "kimi_k25")

# Mixture-of-experts archs: in bf16/fp16 a few tokens flip near-tied expert choices, so
# captures differ from an HF reference by more than rounding on some rows (reference.compare bounds every row,
# no allowance); compare these in float32.
MOE_ARCHITECTURES: tuple[str, ...] = ("qwen3_moe", "deepseek_v3", "gpt_oss", "kimi_k25")

MISTRAL_SLIDING_WINDOW = 256

# Real shapes for the archs make test and the sweep run: head sizes of released models (Llama-3.2:
# 64, Qwen3 / Llama-3.1: 128; Mistral keeps 32) and a trained model's activations: a few
# very-high-norm rows (the BOS token, which the e2e runner puts at position 0, and one frequent
# token: rows ~50x the typical norm, as a trained model's attention-sink rows) and a few high-norm
# channels in every row (x6, ~1/3 of a row's squared norm).
HEAD_DIM = {"llama": 64, "qwen3": 128}
MASSIVE = {"rows": (1, 4), "row_value": 40.0, "row_channels": (11, 71), "channels": (7, 93), "channel_scale": 6.0}
MASSIVE_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen3", "mistral")

# Bump when anything below changes the files that get written (invalidates the cache).
FACTORY_VERSION = 1
VOCAB_SIZE = 1024
SEED = 1234
_COMPLETE_MARKER = ".speculators_compat_complete"

# Initialisation scales (the residual stream must be far from 0 and layers must move it).
_STD_LINEAR = 0.05
_STD_EMBED = 0.1
_STD_ROUTER = 0.2  # larger: fewer near-ties in expert selection between implementations
_STD_NORM = 0.1  # norm weights are 1 + N(0, 0.1) (Gemma: N(0, 0.1), it applies 1 + w)
_STD_BIAS = 0.02


def default_cache_root() -> Path:
    env = os.environ.get("SPECULATORS_COMPAT_MODEL_CACHE")
    if env:
        return Path(env).expanduser()
    return Path("~/.cache/speculators_compat/models").expanduser()


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------

_MODEL_TYPE = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "deepseek_v3": "deepseek_v3",
    "gpt_oss": "gpt_oss",
    "mistral": "mistral",
    "gemma3": "gemma3_text",
    "llava": "llava",
    "kimi_k25": "kimi_k25",
    "qwen3_5": "qwen3_5_text",  # the text-only config (Qwen3_5TextConfig); "qwen3_5" is the VL wrapper
    "qwen3_next": "qwen3_next",
}

_ARCH_CLASS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "llava": "LlavaForConditionalGeneration",
    "kimi_k25": "KimiK25ForConditionalGeneration",
    "qwen3_5": "Qwen3_5ForCausalLM",  # vLLM 0.32 registers it (models/qwen3_5.py), transformers 5 has it
    "qwen3_next": "Qwen3NextForCausalLM",
}

# llava: a tiny CLIP vision tower (vLLM profiles the encoder at start with a dummy image).
# 32 px / patch 16 = 4 patches (+ CLS, dropped by the "default" feature strategy) = 4 image tokens.
_LLAVA_IMAGE_SIZE = 32
_LLAVA_PATCH = 16
_IMAGE_TOKEN = "<image>"  # the last id of the vocabulary (the e2e runner draws ids < 1000)


def _alternating(n: int, first: str, second: str) -> list[str]:
    return [first if i % 2 == 0 else second for i in range(n)]


def tiny_config_kwargs(arch: str, *, num_layers: int = 4, hidden_size: int = 128) -> dict:
    """The config keyword arguments used for ``arch`` (before ``overrides``)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHITECTURES}")
    if not 1 <= num_layers <= 64:
        raise ValueError("num_layers out of range")
    head_dim = HEAD_DIM.get(arch, 32)  # GPU Triton attention needs head size >= 32
    if hidden_size % 32:
        raise ValueError("hidden_size must be a multiple of 32")
    n_heads = max(2, hidden_size // head_dim)
    n_kv = max(1, n_heads // 2)
    common: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        architectures=[_ARCH_CLASS[arch]],
    )
    if arch == "llama":
        common.update(head_dim=head_dim, rope_theta=10000.0)
    elif arch == "kimi_k25":
        return _kimi_k25_config(common, n_heads)
    elif arch == "llava":
        # the text decoder's class, as released Llava checkpoints name it: vLLM < 0.20 builds the
        # language model from text_config.architectures (no fallback from model_type before 0.20)
        text = dict(common, model_type="llama", head_dim=head_dim, rope_theta=10000.0, architectures=["LlamaForCausalLM"])
        return dict(
            text_config=text,
            vision_config=dict(
                model_type="clip_vision_model",
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=2,
                image_size=_LLAVA_IMAGE_SIZE,
                patch_size=_LLAVA_PATCH,
                num_channels=3,
                projection_dim=64,
                hidden_act="quick_gelu",
                layer_norm_eps=1e-5,
            ),
            image_token_index=VOCAB_SIZE - 1,
            image_seq_length=(_LLAVA_IMAGE_SIZE // _LLAVA_PATCH) ** 2,
            projector_hidden_act="gelu",
            vision_feature_select_strategy="default",
            vision_feature_layer=-2,
            tie_word_embeddings=False,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            architectures=[_ARCH_CLASS[arch]],
        )
    elif arch == "mistral":
        # a sliding window shorter than the long test sequences (the e2e runner's 300-2,047 tokens):
        # tokens past it attend to the last MISTRAL_SLIDING_WINDOW positions only, so Mistral runs
        # another attention path than Llama (with no window its cells were bit-identical to Llama's)
        common.update(head_dim=head_dim, rope_theta=10000.0, sliding_window=MISTRAL_SLIDING_WINDOW)
    elif arch == "qwen2":
        common.update(rope_theta=10000.0, use_sliding_window=False, sliding_window=None)
    elif arch == "qwen3":
        common.update(head_dim=head_dim, rope_theta=10000.0, use_sliding_window=False)
    elif arch == "qwen3_moe":
        common.update(
            head_dim=head_dim,
            rope_theta=10000.0,
            use_sliding_window=False,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden_size,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            output_router_logits=False,
        )
    elif arch == "deepseek_v3":
        common.update(
            num_key_value_heads=n_heads,  # MLA: HF eager repeats kv by heads // kv_heads
            rope_theta=10000.0,
            moe_intermediate_size=hidden_size,
            n_shared_experts=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            topk_method="noaux_tc",  # vLLM creates e_score_correction_bias only with this
            scoring_func="sigmoid",
            q_lora_rank=64,
            kv_lora_rank=64,
            qk_rope_head_dim=32,
            qk_nope_head_dim=32,
            v_head_dim=32,
            rope_interleave=True,
            attention_bias=False,
        )
    elif arch == "gpt_oss":
        common.update(
            head_dim=head_dim,
            intermediate_size=hidden_size,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=64,
            layer_types=_alternating(num_layers, "sliding_attention", "full_attention"),
            attention_bias=True,
            rms_norm_eps=1e-5,
            max_position_embeddings=131072,  # = yarn factor 32 x original 4096 (no warning)
        )
    elif arch in HYBRID_ARCHITECTURES:
        # as the released Qwen3.5 / Qwen3-Next configs: layer_types from full_attention_interval
        # (every 4th layer full attention, the rest gated delta-net), gated full attention with
        # partial rope. GDN dims: vLLM's CPU kernel takes key head dim == value head dim, 64 or 128.
        interval = 4
        common.update(
            head_dim=64,
            num_attention_heads=2,
            num_key_value_heads=1,
            rope_theta=10000.0,
            partial_rotary_factor=0.25,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            full_attention_interval=interval,
            layer_types=[
                "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)
            ],
        )
        if num_layers < interval:  # keep at least one full-attention layer
            common["layer_types"][-1] = "full_attention"
        if arch == "qwen3_next":
            # Qwen3-Next is MoE in every layer (routed experts + a gated shared expert), and vLLM's
            # Qwen3NextForCausalLM needs at least one MoE layer ("No Qwen3Next layer found"). vLLM's
            # CPU GDN runs in bf16 only, and in bf16 near-tied routers flip top-k choices (HF bf16 vs
            # HF fp32 alone: worst row 0.56 with top-2 of 8): every token takes all 4 experts
            # (top-k = num_experts), so routing weighs experts continuously and cannot flip.
            common.update(
                num_experts=4,
                num_experts_per_tok=4,
                moe_intermediate_size=hidden_size,
                shared_expert_intermediate_size=hidden_size,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                norm_topk_prob=True,
                output_router_logits=False,
            )
    elif arch == "gemma3":
        common.update(
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            sliding_window=64,
            layer_types=_alternating(num_layers, "sliding_attention", "full_attention"),
            tie_word_embeddings=True,
            hidden_activation="gelu_pytorch_tanh",
            attn_logit_softcapping=None,
            final_logit_softcapping=None,
        )
    return common


# kimi_k25: Kimi-K2.5 as released (moonshotai/Kimi-K2.5): a wrapper config (model_type kimi_k25,
# KimiK25ForConditionalGeneration) around a DeepSeek-V3 text_config, a MoonViT vision tower and a
# patch-merger projector; weights under language_model.model.* / language_model.lm_head /
# vision_tower.* / mm_projector.proj.{0,2}; remote code for the config (auto_map) and the image
# processor (preprocessor_config.json's auto_map + media_proc_cfg). One config.json carries the keys
# both schemas read: vLLM < 0.17's own KimiK25Config (media_placeholder_token_id, vision
# init_pos_emb_*, mm_hidden_size, ...) and transformers 5's Kimi_K25Config (image_token_id,
# projection_hidden_size, vision pos_emb_*), plus the released vt_* keys.
# Media tokens are the last ids of the vocabulary (the e2e runner draws ids < 1000).
_KIMI_MEDIA_TOKENS = (
    "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|kimi_k25_video_placeholder|>", "<|media_pad|>",
)
_KIMI_VISION = dict(hidden=64, intermediate=128, layers=2, heads=2, patch=14, pos_emb=4, frames=4)
# Which overrides go to the wrapper config; every other key goes to text_config (MLA dims,
# routing, llama_4_scaling: the DeepSeek-V3 decoder reads them there).
_KIMI_WRAPPER_KEYS = ("vision_config", "media_placeholder_token_id", "image_token_id", "use_unified_vision_chunk")


def _kimi_k25_config(common: dict, n_heads: int) -> dict:
    """The config.json dict of a tiny Kimi-K2.5 (see the comment above)."""
    vocab = common["vocab_size"]
    tok_id = {t: vocab - len(_KIMI_MEDIA_TOKENS) + i for i, t in enumerate(_KIMI_MEDIA_TOKENS)}
    text = dict(common, model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"])
    text.update(
        num_key_value_heads=n_heads,  # MLA: HF eager repeats kv by heads // kv_heads
        rope_theta=50000.0,
        rms_norm_eps=1e-5,
        moe_intermediate_size=common["hidden_size"],
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,  # released: 1/1 over 384 experts; grouped here so group selection is exercised
        topk_group=2,
        routed_scaling_factor=2.827,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        # MLA dims H200 kernels take (vLLM 0.24: decode kv_lora_rank + rope in {320, 576}; FA3
        # prefill: nope + rope in (128, 192], v in (96, 128]); CPU runs them with MLA off
        q_lora_rank=64,
        kv_lora_rank=256,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        rope_interleave=True,
        attention_bias=False,
        hidden_act="silu",
    )
    v = _KIMI_VISION
    vision = {
        # released keys (moonshotai/Kimi-K2.5 config.json)
        "init_pos_emb_height": v["pos_emb"], "init_pos_emb_width": v["pos_emb"], "init_pos_emb_time": v["frames"],
        "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "mm_hidden_size": v["hidden"],
        "mm_projector_type": "patchmerger", "patch_size": v["patch"], "pos_emb_type": "divided_fixed",
        "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5, "text_hidden_size": common["hidden_size"],
        "video_attn_type": "spatial_temporal", "vt_hidden_size": v["hidden"], "vt_intermediate_size": v["intermediate"],
        "vt_num_attention_heads": v["heads"], "vt_num_hidden_layers": v["layers"],
        # the names vLLM's KimiK25VisionConfig (< 0.17) and transformers 5's Kimi_K25VisionConfig read
        "hidden_size": v["hidden"], "intermediate_size": v["intermediate"], "num_hidden_layers": v["layers"],
        "num_attention_heads": v["heads"], "pos_emb_height": v["pos_emb"], "pos_emb_width": v["pos_emb"],
        "pos_emb_time": v["frames"], "hidden_act": "gelu_pytorch_tanh",
    }
    return {
        "architectures": [_ARCH_CLASS["kimi_k25"]],
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"},
        "model_type": "kimi_k25",
        "bos_token_id": common["bos_token_id"],
        "eos_token_id": common["eos_token_id"],
        "pad_token_id": common["pad_token_id"],
        "ignore_index": -100,
        "media_placeholder_token_id": tok_id["<|media_pad|>"],
        "image_token_id": tok_id["<|media_pad|>"],
        "video_token_id": tok_id["<|kimi_k25_video_placeholder|>"],
        "vision_start_token_id": tok_id["<|media_begin|>"],
        "vision_end_token_id": tok_id["<|media_end|>"],
        "projection_hidden_size": v["hidden"],
        "projection_layer_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "use_unified_vision_chunk": True,
        "video_placeholder": "<|kimi_k25_video_placeholder|>",
        "text_config": text,
        "vision_config": vision,
    }


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------

_SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0, 1, 2, 3

_WORDS = (
    "the a an of to in and is was for on with as by at from that this it be are or not "
    "speculative decoding draft model target verify accept reject token tokens hidden state "
    "states layer layers residual stream norm attention head heads query key value cache "
    "block page batch sequence prompt generate sample greedy logits vocabulary embedding "
    "expert experts router routing gate mixture dense sparse rotary position window sliding "
    "quick brown fox jumps over lazy dog hello world once upon time there lived small "
    "robot who liked numbers zero one two three four five six seven eight nine ten hundred "
    "thousand million question answer why how what when where which who because therefore "
    "python code function return import class def if else while for loop value list dict"
).split()


def _corpus() -> list[str]:
    """A fixed, deterministic corpus (pseudo-random word sequences, no global RNG)."""
    lines = []
    x = 2463534242
    for _ in range(3000):
        words = []
        for _ in range(12):
            x ^= (x << 13) & 0xFFFFFFFF
            x ^= x >> 17
            x ^= (x << 5) & 0xFFFFFFFF
            words.append(_WORDS[x % len(_WORDS)])
        lines.append(" ".join(words) + ".")
    lines.append("0123456789 !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~ ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    return lines


def _build_tokenizer(vocab_size: int, extra_special: tuple[str, ...] = ()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # Pad to exactly vocab_size so every id the model can emit decodes; extra_special
    # (e.g. llava's "<image>") take the last ids.
    n = tok.get_vocab_size()
    target = vocab_size - len(extra_special)
    if n > target:
        raise ValueError(f"BPE vocabulary ({n}) leaves no room for {extra_special}")
    if n < target:
        tok.add_special_tokens([f"<extra_{i}>" for i in range(target - n)])
    if extra_special:
        tok.add_special_tokens(list(extra_special))
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    # Prepend BOS like Llama-style tokenizers do.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=4096,
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    return fast


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------


def _name_seed(name: str) -> int:
    return (SEED * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFFFFFF


def _init_tensor(name: str, t, arch: str) -> None:
    import torch

    g = torch.Generator().manual_seed(_name_seed(name))
    shape = t.shape
    leaf = name.rsplit(".", 1)[-1]
    lname = name.lower()

    def randn(std: float):
        return torch.randn(shape, generator=g, dtype=torch.float32) * std

    if "norm" in lname and t.dim() == 1:
        # Gemma, Qwen3.5 and Qwen3-Next RMSNorms multiply by (1 + w); the gated delta-net's own
        # output norm (linear_attn.norm) multiplies by w
        offset_norm = arch == "gemma3" or (arch in HYBRID_ARCHITECTURES and "linear_attn.norm" not in lname)
        base = 0.0 if offset_norm else 1.0
        val = base + randn(_STD_NORM)
    elif leaf == "e_score_correction_bias":
        val = randn(0.1)  # non-zero so the noaux_tc bias affects expert selection
    elif leaf == "sinks":
        val = randn(1.0)
    elif "embed_tokens" in lname:
        val = randn(_STD_EMBED)
        if arch in MASSIVE_ARCHITECTURES and t.dim() == 2:
            val[:, list(MASSIVE["channels"])] *= MASSIVE["channel_scale"]
            for row in MASSIVE["rows"]:
                val[row, list(MASSIVE["row_channels"])] = MASSIVE["row_value"]
    elif ("router" in lname or lname.endswith("mlp.gate.weight")) and leaf in ("weight",):
        val = randn(_STD_ROUTER)
    elif leaf.endswith("bias") or t.dim() == 1:
        val = randn(_STD_BIAS)
    else:
        val = randn(_STD_LINEAR)
    with torch.no_grad():
        t.copy_(val.to(t.dtype))


def _reinit_checkpoint(directory: Path, arch: str) -> None:
    """Overwrite every tensor of the saved checkpoint with seeded values keyed by its saved
    name.  transformers 4.x and 5.x save the same key names and shapes for these models
    (5.x converts fused MoE experts back on save), so the weights do not depend on the
    transformers version nor on its module creation order / init functions."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    for path in sorted(directory.glob("*.safetensors")):
        tensors = {}
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            for key in sorted(f.keys()):
                t = f.get_tensor(key)
                key = _checkpoint_key(arch, key)
                new = torch.empty(t.shape, dtype=torch.float32)
                _init_tensor(key, new, arch)
                tensors[key] = new.to(t.dtype).contiguous()
        metadata = {"format": metadata.get("format", "pt")}
        save_file(tensors, str(path), metadata=metadata)


def _checkpoint_key(arch: str, key: str) -> str:
    """The name a tensor is saved under: the released checkpoints' layout.

    transformers 5 saves llava's CLIP tower as ``vision_tower.embeddings...``; released llava
    checkpoints (and vLLM's loader, and transformers 4 and 5 when loading) use
    ``vision_tower.vision_model.embeddings...``."""
    if arch == "llava" and key.startswith("vision_tower.") and not key.startswith("vision_tower.vision_model."):
        return "vision_tower.vision_model." + key[len("vision_tower."):]
    return key


def hf_unsupported_reason(arch: str) -> str | None:
    """Why the installed transformers cannot build ``arch`` (no config class for its model type),
    or None. Kimi-K2.5 ships its own config code (remote code), so it is always buildable."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}")
    if arch == "kimi_k25":
        return None
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if _MODEL_TYPE[arch] not in CONFIG_MAPPING:
        return (f"transformers {transformers.__version__} has no {_MODEL_TYPE[arch]!r} config "
                f"(arch {arch!r} needs a newer transformers)")
    return None


def _make_config(arch: str, kwargs: dict):
    from transformers import AutoConfig

    reason = hf_unsupported_reason(arch)
    if reason:
        raise ValueError(reason)

    cfg = AutoConfig.for_model(_MODEL_TYPE[arch], **kwargs)
    # Some keys (e.g. topk_method, scoring_func for deepseek_v3) are not constructor
    # arguments in every transformers version; make sure they are on the config.
    for k, v in kwargs.items():
        if k in ("rope_theta", "rope_scaling"):
            continue  # transformers 5 folds these into rope_parameters
        if not hasattr(cfg, k):
            setattr(cfg, k, v)
    return cfg


def _model_class(arch: str):
    """The transformers auto class that builds ``arch`` from its config."""
    if arch in MULTIMODAL_ARCHITECTURES:
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


def _save_processor(arch: str, directory: Path) -> None:
    """Tokenizer (with the image token), image processor and processor of a multimodal arch."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    tok = _build_tokenizer(VOCAB_SIZE, extra_special=(_IMAGE_TOKEN,))
    assert tok.convert_tokens_to_ids(_IMAGE_TOKEN) == VOCAB_SIZE - 1
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": _LLAVA_IMAGE_SIZE},
        crop_size={"height": _LLAVA_IMAGE_SIZE, "width": _LLAVA_IMAGE_SIZE},
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=_LLAVA_PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS
        image_token=_IMAGE_TOKEN,
        chat_template=tok.chat_template,
    )
    processor.save_pretrained(directory)
    tok.save_pretrained(directory)


# Remote code written into the tiny Kimi-K2.5 checkpoint (the released one ships its own
# configuration_kimi_k25.py and kimi_k25_vision_processing.py; these are minimal stand-ins with the
# same class names and the attributes their callers read). speculators' generator loads the config
# with AutoConfig(trust_remote_code=True): transformers 4.57 knows no kimi_k25. vLLM < 0.17 loads
# the image processor with trust_remote_code=True; vLLM 0.32 reads media_proc_cfg itself.
_KIMI_CONFIG_CODE = '''"""Kimi-K2.5 config (tiny test checkpoint of speculators-compat; released layout)."""
from transformers import DeepseekV3Config

try:
    from transformers import PreTrainedConfig as _Base
except ImportError:  # transformers < 5
    from transformers import PretrainedConfig as _Base


class KimiK25VisionConfig(_Base):
    model_type = "kimi_k25_vision"

    def __init__(self, patch_size=14, init_pos_emb_height=64, init_pos_emb_width=64, init_pos_emb_time=4,
                 pos_emb_type="divided_fixed", num_attention_heads=16, num_hidden_layers=27, hidden_size=1152,
                 intermediate_size=4304, merge_kernel_size=(2, 2), video_attn_type="spatial_temporal",
                 merge_type="sd2_tpool", mm_projector_type="patchmerger", mm_hidden_size=None,
                 projector_hidden_act="gelu", projector_ln_eps=1e-5, **kwargs):
        super().__init__(**kwargs)
        self.patch_size = patch_size
        self.init_pos_emb_height = init_pos_emb_height
        self.init_pos_emb_width = init_pos_emb_width
        self.init_pos_emb_time = init_pos_emb_time
        self.pos_emb_type = pos_emb_type
        self.num_attention_heads = num_attention_heads
        self.num_hidden_layers = num_hidden_layers
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.merge_kernel_size = merge_kernel_size
        self.video_attn_type = video_attn_type
        self.merge_type = merge_type
        self.mm_projector_type = mm_projector_type
        self.mm_hidden_size = hidden_size if mm_hidden_size is None else mm_hidden_size
        self.projector_hidden_act = projector_hidden_act
        self.projector_ln_eps = projector_ln_eps


class KimiK25Config(_Base):
    model_type = "kimi_k25"
    sub_configs = {"text_config": DeepseekV3Config, "vision_config": KimiK25VisionConfig}

    def __init__(self, vision_config=None, text_config=None, ignore_index=-100, media_placeholder_token_id=163605,
                 pad_token_id=0, use_unified_vision_chunk=False,
                 video_placeholder="<|kimi_k25_video_placeholder|>", **kwargs):
        if vision_config is None:
            vision_config = KimiK25VisionConfig()
        elif isinstance(vision_config, dict):
            vision_config = KimiK25VisionConfig(**vision_config)
        self.vision_config = vision_config
        if text_config is None:
            text_config = DeepseekV3Config()
        elif isinstance(text_config, dict):
            text_config = DeepseekV3Config(**{k: v for k, v in text_config.items() if k != "model_type"})
        self.text_config = text_config
        self.ignore_index = ignore_index
        self.media_placeholder_token_id = media_placeholder_token_id
        self.use_unified_vision_chunk = use_unified_vision_chunk
        self.video_placeholder = video_placeholder
        super().__init__(pad_token_id=pad_token_id, **kwargs)

    @property
    def hidden_size(self):
        return self.text_config.hidden_size

    @property
    def vocab_size(self):
        return self.text_config.vocab_size
'''

_KIMI_PROCESSOR_CODE = '''"""Kimi-K2.5 vision-chunk image processor (tiny test checkpoint of speculators-compat).

The attributes vLLM's Kimi-K2.5 processing reads: media_tokens_calculator, num_frames_per_chunk,
preprocess, split_video_chunks. NaViT-style: each frame is scaled (aspect kept) to at most
in_patch_limit patches of patch_size (and patch_limit_on_one_side per side), cut to whole
merge_kernel_size x merge_kernel_size blocks; a chunk of t frames gives grid (t, h, w) and
(h / merge) * (w / merge) tokens (the frames are pooled)."""
import math

import numpy as np
import torch
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature


class KimiK25VisionProcessor(BaseImageProcessor):
    model_input_names = ["pixel_values", "grid_thws"]

    def __init__(self, media_proc_cfg=None, **kwargs):
        super().__init__(**kwargs)
        self.media_proc_cfg = dict(media_proc_cfg or {})
        self.num_frames_per_chunk = int(self.media_proc_cfg.get("temporal_merge_kernel_size", 4))

    def _size(self, width, height):
        c = self.media_proc_cfg
        ps, m = int(c.get("patch_size", 14)), int(c.get("merge_kernel_size", 2))
        limit, side = int(c.get("in_patch_limit", 16)), int(c.get("patch_limit_on_one_side", 4))
        scale = min(1.0, math.sqrt(limit * ps * ps / (width * height)), side * ps / width, side * ps / height)
        unit = ps * m
        return max(unit, int(width * scale) // unit * unit), max(unit, int(height * scale) // unit * unit)

    @staticmethod
    def _frames(chunk):
        return [chunk["image"]] if chunk["type"] == "image" else list(chunk["video_chunk"])

    def media_tokens_calculator(self, chunk):
        w, h = self._size(*self._frames(chunk)[0].size)
        unit = int(self.media_proc_cfg.get("patch_size", 14)) * int(self.media_proc_cfg.get("merge_kernel_size", 2))
        return (w // unit) * (h // unit)

    def split_video_chunks(self, video):
        n = self.num_frames_per_chunk
        return [{"type": "video_chunk", "video_chunk": list(video[i:i + n])} for i in range(0, len(video), n)]

    def preprocess(self, chunks, **kwargs):
        c = self.media_proc_cfg
        ps = int(c.get("patch_size", 14))
        mean = np.asarray(c.get("image_mean", [0.5, 0.5, 0.5]), dtype=np.float32)
        std = np.asarray(c.get("image_std", [0.5, 0.5, 0.5]), dtype=np.float32)
        patches, grids = [], []
        for chunk in chunks:
            frames = self._frames(chunk)
            w, h = self._size(*frames[0].size)
            arr = np.stack([np.asarray(f.convert("RGB").resize((w, h)), dtype=np.float32) / 255.0 for f in frames])
            arr = ((arr - mean) / std).transpose(0, 3, 1, 2)  # t, 3, h, w
            t, gh, gw = arr.shape[0], h // ps, w // ps
            arr = arr.reshape(t, 3, gh, ps, gw, ps).transpose(0, 2, 4, 1, 3, 5).reshape(-1, 3, ps, ps)
            patches.append(torch.from_numpy(np.ascontiguousarray(arr)))
            grids.append([t, gh, gw])
        return BatchFeature(data={"pixel_values": torch.cat(patches), "grid_thws": torch.tensor(grids)})
'''

_KIMI_MEDIA_PROC_CFG = {
    "patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 16, "patch_limit_on_one_side": 4,
    "fixed_output_tokens": None, "in_patch_limit_each_frame": 16, "in_patch_limit_video": None,
    "max_num_frames_each_video": None, "fixed_output_tokens_each_frame": None, "sample_fps": 2.0,
    "temporal_merge_kernel_size": 4, "timestamp_mode": "hh:mm:ss.fff",
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}


def _kimi_vision_shapes(vision: dict, text_hidden: int) -> dict[str, tuple[int, ...]]:
    """Vision tower + projector tensors, named as the released checkpoint names them."""
    v, i, ps = vision["hidden_size"], vision["intermediate_size"], vision["patch_size"]
    kh, kw = vision["merge_kernel_size"]
    out: dict[str, tuple[int, ...]] = {
        "vision_tower.patch_embed.proj.weight": (v, 3, ps, ps),
        "vision_tower.patch_embed.proj.bias": (v,),
        "vision_tower.patch_embed.pos_emb.weight": (vision["init_pos_emb_height"], vision["init_pos_emb_width"], v),
        "vision_tower.encoder.final_layernorm.weight": (v,),
        "vision_tower.encoder.final_layernorm.bias": (v,),
        "mm_projector.pre_norm.weight": (v,),
        "mm_projector.pre_norm.bias": (v,),
        "mm_projector.proj.0.weight": (v * kh * kw, v * kh * kw),
        "mm_projector.proj.0.bias": (v * kh * kw,),
        "mm_projector.proj.2.weight": (text_hidden, v * kh * kw),
        "mm_projector.proj.2.bias": (text_hidden,),
    }
    for b in range(vision["num_hidden_layers"]):
        p = f"vision_tower.encoder.blocks.{b}."
        out.update({
            p + "norm0.weight": (v,), p + "norm0.bias": (v,), p + "norm1.weight": (v,), p + "norm1.bias": (v,),
            p + "wqkv.weight": (3 * v, v), p + "wqkv.bias": (3 * v,), p + "wo.weight": (v, v), p + "wo.bias": (v,),
            p + "mlp.fc0.weight": (i, v), p + "mlp.fc0.bias": (i,), p + "mlp.fc1.weight": (v, i), p + "mlp.fc1.bias": (v,),
        })
    return out


def _kimi_apply_overrides(cfg: dict, overrides: dict) -> dict:
    """Overrides go to text_config (the decoder reads MLA dims, routing, llama_4_scaling there),
    except the wrapper's own keys; ``text_config`` / ``vision_config`` dicts are merged."""
    cfg = json.loads(json.dumps(cfg))
    for k, v in overrides.items():
        if k in ("text_config", "vision_config") and isinstance(v, dict):
            cfg[k].update(v)
        elif k in _KIMI_WRAPPER_KEYS:
            cfg[k] = v
        else:
            cfg["text_config"][k] = v
    return cfg


def _build_kimi_k25(directory: Path, cfg: dict, dtype: str) -> None:
    """Write a tiny Kimi-K2.5 checkpoint (released layout) into ``directory``.

    The text decoder's tensor names and shapes come from transformers' DeepseekV3ForCausalLM
    (saved, then prefixed with ``language_model.``); the vision tower's and projector's from
    :func:`_kimi_vision_shapes`. Every tensor is then drawn from its per-name seed, so the
    weights do not depend on which transformers wrote them."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    text_kwargs = {k: v for k, v in cfg["text_config"].items() if k != "model_type"}
    text_cfg = _make_config("deepseek_v3", text_kwargs)
    scratch = directory / "_text"
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            model = AutoModelForCausalLM.from_config(text_cfg)
    finally:
        torch.set_default_dtype(prev)
    model.save_pretrained(scratch, safe_serialization=True)
    del model
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(scratch.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                shapes["language_model." + key] = tuple(f.get_slice(key).get_shape())
    shutil.rmtree(scratch)
    shapes.update(_kimi_vision_shapes(cfg["vision_config"], cfg["text_config"]["hidden_size"]))
    tensors = {}
    for name in sorted(shapes):
        t = torch.empty(shapes[name], dtype=torch.float32)
        _init_tensor(name, t, "kimi_k25")
        keep_fp32 = name.endswith("e_score_correction_bias")  # float32 in the released checkpoint
        tensors[name] = t if keep_fp32 else t.to(getattr(torch, dtype)).contiguous()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(dict(cfg, dtype=dtype, torch_dtype=dtype), indent=2, sort_keys=True) + "\n")
    (directory / "configuration_kimi_k25.py").write_text(_KIMI_CONFIG_CODE)
    (directory / "kimi_k25_vision_processing.py").write_text(_KIMI_PROCESSOR_CODE)
    (directory / "preprocessor_config.json").write_text(json.dumps({
        "auto_map": {"AutoImageProcessor": "kimi_k25_vision_processing.KimiK25VisionProcessor"},
        "media_proc_cfg": _KIMI_MEDIA_PROC_CFG,
    }, indent=2, sort_keys=True) + "\n")
    tok = _build_tokenizer(VOCAB_SIZE, extra_special=_KIMI_MEDIA_TOKENS)
    assert tok.convert_tokens_to_ids("<|media_pad|>") == cfg["media_placeholder_token_id"]
    tok.save_pretrained(directory)


# --------------------------------------------------------------------------------------------
# INT4 as released (quantization="w4a16"): Kimi-K2.5's routed experts in compressed-tensors
# pack-quantized W4A16 (int4, symmetric, group 32), everything else in the checkpoint dtype
# --------------------------------------------------------------------------------------------

QUANTIZATIONS: tuple[str, ...] = ("w4a16",)
_QUANTIZED_ARCHES = {"w4a16": ("kimi_k25",)}

# The quantization_config block as moonshotai/Kimi-K2.5 (and Kimi-K2-Thinking / K2.6) write it,
# inside text_config (vLLM >= 0.16 reads text_config.quantization_config of a multimodal
# wrapper). Sources: the ignore list vLLM's humming test quotes as "the real ignore list from
# Kimi-K2.6's compressed-tensors quantization_config", and public Kimi-K2.5 fixtures of the same
# block; Kimi-K2-Thinking (text only) has the first four ignore entries.
KIMI_K25_W4A16_QUANTIZATION_CONFIG: dict[str, Any] = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": 32,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "ignore": [
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
        "re:.*lm_head.*",
        "re:vision_tower.*",
        "re:mm_projector.*",
    ],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}

# The Linear weights the released checkpoint packs: the routed experts' (every other Linear is
# matched by an ignore entry; the router ``mlp.gate`` is no Linear in HF nor quantized in vLLM).
_ROUTED_EXPERT_WEIGHT = r"^language_model\.model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$"
DEQUANTIZED_SUBDIR = "dequantized"


def quantization_ignored(module: str, ignore: list[str] | None = None) -> bool:
    """Whether ``module`` (a dotted module name) matches the ignore list as compressed-tensors
    matches it: ``re:`` entries with ``re.match`` (anchored at the start), others exactly or as
    a name suffix."""
    import re

    for entry in KIMI_K25_W4A16_QUANTIZATION_CONFIG["ignore"] if ignore is None else ignore:
        if entry.startswith("re:"):
            if re.match(entry[3:], module):
                return True
        elif module == entry or module.endswith("." + entry):
            return True
    return False


def quantized_weight_names(names) -> list[str]:
    """Of a checkpoint's bf16/float tensor names, the ``*.weight`` tensors the w4a16 variant packs."""
    import re

    out = [n for n in names if re.match(_ROUTED_EXPERT_WEIGHT, n)]
    for n in out:  # the ignore list must not cover what gets packed (it is what vLLM reads)
        assert not quantization_ignored(n[: -len(".weight")]), n
    return sorted(out)


def _w4a16_args():
    from compressed_tensors.quantization import QuantizationArgs

    w = KIMI_K25_W4A16_QUANTIZATION_CONFIG["config_groups"]["group_0"]["weights"]
    return QuantizationArgs(**w)


def quantize_w4a16(weight, scale_dtype):
    """Pack one ``[out, in]`` weight as compressed-tensors' pack-quantized W4A16 (int4,
    symmetric, group 32, minmax observer); returns ``(tensors, dequantized)`` where ``tensors``
    holds ``weight_packed`` (int32 ``[out, in/8]``), ``weight_scale`` (``[out, in/32]`` in
    ``scale_dtype``) and ``weight_shape`` (int64 ``[2]``), and ``dequantized`` is what a
    W4A16 kernel multiplies by (float32: ``q * scale``)."""
    import torch
    from compressed_tensors.compressors import pack_to_int32, unpack_from_int32
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = _w4a16_args()
    gs = args.group_size
    w = weight.detach().to(torch.float32)
    out_f, in_f = w.shape
    if in_f % gs:
        raise ValueError(f"in_features {in_f} is no multiple of the group size {gs}")
    grouped = w.reshape(out_f, in_f // gs, gs)
    scale, zp = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    scale = scale.to(scale_dtype).to(torch.float32)  # stored in scale_dtype: quantize with that value
    q = quantize(x=w, scale=scale, zero_point=zp, args=args, dtype=torch.int8)
    packed = pack_to_int32(q, args.num_bits)
    unpacked = unpack_from_int32(packed, args.num_bits, torch.Size(w.shape))
    assert torch.equal(unpacked.to(torch.int8), q.to(torch.int8)), "pack/unpack round trip"
    deq = dequantize(x_q=unpacked, scale=scale, zero_point=None, args=args, dtype=torch.float32)
    tensors = {
        "weight_packed": packed.contiguous(),
        "weight_scale": scale.to(scale_dtype).contiguous(),
        "weight_shape": torch.tensor([out_f, in_f], dtype=torch.int64),
    }
    return tensors, deq


def _quantize_kimi_w4a16(directory: Path, dtype: str) -> dict:
    """Turn the bf16/float Kimi-K2.5 checkpoint in ``directory`` into the INT4 one as released;
    write the dequantized weights (the same model, unpacked) under ``dequantized/`` for HF.
    Returns a summary for the marker file."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    src = directory / "model.safetensors"
    with safe_open(str(src), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    targets = quantized_weight_names(tensors)
    if not targets:
        raise RuntimeError("no routed-expert weights to quantize")
    packed: dict = {}
    dequantized: dict = {}
    worst = 0.0
    for name, t in tensors.items():
        if name in targets:
            parts, deq = quantize_w4a16(t, t.dtype)
            base = name[: -len(".weight")]
            for suffix, v in parts.items():
                packed[f"{base}.{suffix}"] = v
            dequantized[name] = deq.to(t.dtype).contiguous()
            ref = t.to(torch.float32)
            worst = max(worst, float((deq - ref).norm() / ref.norm()))
        else:
            packed[name] = t
            dequantized[name] = t
    deq_dir = directory / DEQUANTIZED_SUBDIR
    deq_dir.mkdir()
    for p in directory.iterdir():  # config, tokenizer, remote code, processor: the same files
        if p.is_file() and p.name != "model.safetensors":
            shutil.copy2(p, deq_dir / p.name)
    save_file(dequantized, str(deq_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(packed, str(src), metadata={"format": "pt"})
    cfg = json.loads((directory / "config.json").read_text())
    cfg["text_config"]["quantization_config"] = json.loads(json.dumps(KIMI_K25_W4A16_QUANTIZATION_CONFIG))
    (directory / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return {"quantized_weights": len(targets), "max_relative_weight_error": worst}


def hf_reference_dir(model_dir: str | Path) -> Path:
    """Where HF loads ``model_dir``'s weights from: its dequantized copy for a quantized tiny model
    (HF on the dequantized weights is the reference), else the directory itself."""
    d = Path(model_dir) / DEQUANTIZED_SUBDIR
    return d if (d / "model.safetensors").exists() else Path(model_dir)


def _transformers_major() -> int:
    import transformers

    from speculators_compat.versions import normalize

    return normalize(transformers.__version__).major


def _cache_key(
    arch: str, num_layers: int, hidden_size: int, dtype: str, overrides: dict, quantization: str | None = None
) -> str:
    extra = {} if quantization is None else {"quantization": quantization, "qconfig": KIMI_K25_W4A16_QUANTIZATION_CONFIG}
    payload = json.dumps(
        {
            **extra,
            "factory": FACTORY_VERSION,
            "arch": arch,
            "num_layers": num_layers,
            "hidden_size": hidden_size,
            "dtype": dtype,
            "config": tiny_config_kwargs(arch, num_layers=num_layers, hidden_size=hidden_size),
            "overrides": overrides,
            **({"massive": MASSIVE} if arch in MASSIVE_ARCHITECTURES else {}),
        },
        sort_keys=True,
        default=repr,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:10]


def _build_hf_checkpoint(tmp: Path, arch: str, cfg, dtype: str) -> None:
    """The checkpoint of an arch transformers builds from its config (every arch but kimi_k25)."""
    import torch

    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            model = _model_class(arch).from_config(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.eval()
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
    model.save_pretrained(tmp, safe_serialization=True)
    _reinit_checkpoint(tmp, arch)
    if arch in MULTIMODAL_ARCHITECTURES:
        _save_processor(arch, tmp)
    else:
        tok = _build_tokenizer(cfg.vocab_size)
        tok.save_pretrained(tmp)


def build_tiny_model(
    arch: str,
    root: str | Path | None = None,
    *,
    num_layers: int = 4,
    hidden_size: int = 128,
    dtype: str = "float32",
    overrides: dict | None = None,
    quantization: str | None = None,
) -> Path:
    """Build (or reuse from the cache) a tiny random checkpoint of ``arch``; return its dir.

    ``quantization="w4a16"`` (kimi_k25 only): Kimi-K2.5 INT4 as released: the routed experts'
    weights in compressed-tensors pack-quantized W4A16 (int4 symmetric, group 32), the released
    ``quantization_config`` in ``text_config``, every ignored module in ``dtype``; the same
    model dequantized lies in ``<dir>/dequantized/`` (:func:`hf_reference_dir`) for HF.

    The directory ``<root>/<arch>-l<layers>-h<hidden>-<dtype>-tf<major>-<hash>`` holds
    ``config.json``, ``model.safetensors``, tokenizer files and a completion marker.
    ``root`` defaults to ``$SPECULATORS_COMPAT_MODEL_CACHE`` or
    ``~/.cache/speculators_compat/models``.  The transformers major version is part of the
    name because transformers 5 saves some configs (rope_parameters) differently.
    Same inputs (and the same transformers/torch) give byte-identical safetensors.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHITECTURES}")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"unsupported dtype {dtype!r}")
    if quantization is not None and (quantization not in QUANTIZATIONS or arch not in _QUANTIZED_ARCHES[quantization]):
        raise ValueError(f"quantization {quantization!r} is not built for {arch!r} ({_QUANTIZED_ARCHES})")
    overrides = dict(overrides or {})
    root = Path(root).expanduser() if root is not None else default_cache_root()
    tf_major = _transformers_major()
    key = _cache_key(arch, num_layers, hidden_size, dtype, overrides, quantization)
    qtag = f"-{quantization}" if quantization else ""
    name = f"{arch}{qtag}-l{num_layers}-h{hidden_size}-{dtype}-tf{tf_major}-{key}"
    final = root / name
    if (final / _COMPLETE_MARKER).exists():
        return final


    root.mkdir(parents=True, exist_ok=True)
    kwargs = tiny_config_kwargs(arch, num_layers=num_layers, hidden_size=hidden_size)
    if arch == "kimi_k25":  # a wrapper config written as JSON (transformers 4 has no class for it)
        kwargs = _kimi_apply_overrides(kwargs, overrides)
    else:
        kwargs.update(overrides)
        cfg = _make_config(arch, kwargs)

    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    try:
        if arch == "kimi_k25":
            _build_kimi_k25(tmp, kwargs, dtype)
        else:
            _build_hf_checkpoint(tmp, arch, cfg, dtype)
        qinfo = _quantize_kimi_w4a16(tmp, dtype) if quantization == "w4a16" else None
        (tmp / "speculators_compat_tiny.json").write_text(
            json.dumps(
                {"arch": arch, "factory_version": FACTORY_VERSION, "key": key,
                 "num_layers": num_layers, "hidden_size": hidden_size, "dtype": dtype,
                 "overrides": overrides, **({"quantization": quantization, **qinfo} if qinfo else {})},
                sort_keys=True, indent=1, default=repr,
            )
        )
        (tmp / _COMPLETE_MARKER).write_text("ok\n")
        try:
            os.rename(tmp, final)
        except OSError:
            # Someone else finished first (or a stale incomplete dir is in the way).
            if (final / _COMPLETE_MARKER).exists():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


# --------------------------------------------------------------------------------------------
# vLLM knobs per arch / platform (data, with one-line reasons)
# --------------------------------------------------------------------------------------------

# (arch, platform) -> {kwarg: (value, reason)}; platform "*" applies everywhere.
_VLLM_KWARGS: dict[tuple[str, str], dict[str, tuple[Any, str]]] = {
    ("deepseek_v3", "cpu"): {
        "compilation_config": (
            {"custom_ops": ["-rotary_embedding"]},
            "CPU rotary_embedding custom op is wrong for non-neox (interleaved) rope",
        ),
    },
    ("kimi_k25", "*"): {
        "trust_remote_code": (
            True,
            "the released checkpoint ships its config and image processor as remote code "
            "(vLLM 0.16 loads the processor with it regardless; speculators' generator passes it)",
        ),
    },
    ("kimi_k25", "cpu"): {  # its text decoder is DeepSeek-V3's
        "compilation_config": (
            {"custom_ops": ["-rotary_embedding"]},
            "CPU rotary_embedding custom op is wrong for non-neox (interleaved) rope",
        ),
    },
}

# (arch, platform) -> {ENV: (value, reason)}
_VLLM_ENV: dict[tuple[str, str], dict[str, tuple[str, str]]] = {
    ("*", "cpu"): {
        "VLLM_CPU_KVCACHE_SPACE": ("1", "1 GiB KV cache is plenty for tiny models"),
    },
    ("deepseek_v3", "cpu"): {
        "VLLM_MLA_DISABLE": ("1", "CPU has no MLA for these dims (0.32: only head size 576)"),
    },
    ("kimi_k25", "cpu"): {
        "VLLM_MLA_DISABLE": ("1", "CPU has no MLA for these dims (0.32: only head size 576)"),
    },
}


# Measured: vllm.LLM(model=<tiny dir>, dtype=..., enforce_eager=True, max_model_len=2048,
# **vllm_engine_kwargs(...)) with vllm_env(...) on CPU, 2 prompts x 16 greedy tokens, compared
# with HF greedy generation on the same weights.
#   vllm-cpu 0.16.0 (transformers 4.57.6), float32: llama qwen2 qwen3 qwen3_moe deepseek_v3
#     mistral gemma3 load, generate and match HF greedy for 16/16 tokens.  gpt_oss fails at the
#     first forward: "RuntimeError: expected scalar type BFloat16 but found Float" in
#     torch.ops._C.cpu_attention_with_kv_cache (the 0.16 CPU kernel takes attention sinks in
#     bf16 only); with dtype="bfloat16" gpt_oss runs (0.32's backend casts sinks to fp32).
#   vllm-cpu 0.32.0 (transformers 5.19.0), float32: all 8 load, generate, match HF greedy.
# (arch, platform) -> [(min_vllm_version_that_works, dtypes_affected, reason)]
_NO_RELEASE_YET = "1000000"  # no vLLM release runs it yet
_VLLM_DTYPE_LIMITS: dict[tuple[str, str], list[tuple[str, tuple[str, ...], str]]] = {
    ("gpt_oss", "cpu"): [
        (
            "0.32",  # measured: 0.16 fails, 0.32 works; versions between not measured
            ("float32", "float16"),
            "vLLM CPU attention kernel supports gpt-oss attention sinks only in bf16 "
            "(0.16: 'expected scalar type BFloat16 but found Float')",
        )
    ],
    # measured on vLLM 0.32 CPU (AVX2): "CPU GDN attention requires BF16" for float32
    ("qwen3_5", "cpu"): [(_NO_RELEASE_YET, ("float32", "float16"), "vLLM's CPU gated delta-net attention requires bf16")],
    ("qwen3_next", "cpu"): [(_NO_RELEASE_YET, ("float32", "float16"), "vLLM's CPU gated delta-net attention requires bf16")],
}


def vllm_unsupported_reason(
    arch: str, vllm_version: str, platform: str = "cpu", dtype: str = "float32"
) -> str | None:
    """Why ``arch`` cannot run in vLLM ``vllm_version`` on ``platform`` in ``dtype``, or None
    (None = no known problem; see the measured table above)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}")
    from speculators_compat.versions import normalize

    ver = normalize(vllm_version)
    for min_ok, dtypes, reason in _VLLM_DTYPE_LIMITS.get((arch, _platform(platform)), []):
        if dtype in dtypes and ver < normalize(min_ok):
            return reason
    return None


def _platform(platform: str) -> str:
    p = platform.lower()
    return "cuda" if p in ("gpu", "cuda", "nvidia") else p


def _merge(table: dict, arch: str, platform: str) -> dict:
    out: dict = {}
    for key in (("*", "*"), ("*", platform), (arch, "*"), (arch, platform)):
        for k, (v, _reason) in table.get(key, {}).items():
            out[k] = v
    return out


def vllm_engine_kwargs(arch: str, platform: str = "cpu") -> dict:
    """Extra ``vllm.LLM(...)`` kwargs that ``arch`` needs on ``platform`` ("cpu"/"cuda"); none of
    them depends on the vLLM release (measured on 0.16 and 0.32), so none is asked for."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}")
    import copy

    return copy.deepcopy(_merge(_VLLM_KWARGS, arch, _platform(platform)))


def vllm_env(arch: str, platform: str = "cpu") -> dict[str, str]:
    """Environment variables to set (before vLLM starts) for ``arch`` on ``platform``."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}")
    return _merge(_VLLM_ENV, arch, _platform(platform))
