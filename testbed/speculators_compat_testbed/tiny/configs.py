"""Tiny checkpoints: the architectures and the config of each.

The arch lists (MoE, multimodal, hybrid, "massive"-activation archs), the shared constants of the
factory (vocabulary size, seed, factory version), the config keyword arguments per arch
(:func:`tiny_config_kwargs`, with Kimi-K2.5's wrapper config), and turning them into a
transformers config (:func:`hf_unsupported_reason`, ``_make_config``, ``_model_class``).

transformers is imported lazily inside functions.
"""

from __future__ import annotations

from typing import Any

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
MULTIMODAL_ARCHITECTURES: tuple[str, ...] = ("llava", "kimi_k25", "qwen3_5")

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

# Bump when anything in the factory (this package) changes the files that get written (invalidates
# the cache).
FACTORY_VERSION = 1
VOCAB_SIZE = 1024
SEED = 1234

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
    "qwen3_5": "qwen3_5",  # the VL wrapper, as released Qwen3.5 checkpoints (text_config: qwen3_5_text)
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
    # as released (Qwen/Qwen3.5-27B): vLLM 0.24 refuses the text-only Qwen3_5ForCausalLM + Qwen3_5TextConfig
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_next": "Qwen3NextForCausalLM",
}

# llava: a tiny CLIP vision tower (vLLM profiles the encoder at start with a dummy image).
# 32 px / patch 16 = 4 patches (+ CLS, dropped by the "default" feature strategy) = 4 image tokens.
_LLAVA_IMAGE_SIZE = 32
_LLAVA_PATCH = 16
_IMAGE_TOKEN = "<image>"  # the last id of the vocabulary (the e2e runner draws ids < 1000)
# qwen3_5: a one-block Qwen3.5 vision tower (patch, temporal patch and merge sizes as released);
# its special tokens take the last ids of the vocabulary, in this order
_QWEN35_VISION = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, in_channels=3, patch_size=16,
                      temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=64,
                      hidden_act="gelu_pytorch_tanh", deepstack_visual_indexes=[])
_QWEN35_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


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
        if arch == "qwen3_5":  # the released layout: a VL wrapper around the text config
            ids = {t: VOCAB_SIZE - len(_QWEN35_TOKENS) + i for i, t in enumerate(_QWEN35_TOKENS)}
            text = {k: v for k, v in common.items() if k not in ("architectures", "rope_theta")}
            # interleaved multimodal rope as released ([11, 11, 10] of head_dim 256 x 0.25 / 2 = 32)
            text["rope_parameters"] = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                                           mrope_section=[3, 3, 2], mrope_interleaved=True)
            return dict(
                text_config=dict(text, model_type="qwen3_5_text"),
                vision_config=dict(_QWEN35_VISION, out_hidden_size=hidden_size),
                vision_start_token_id=ids["<|vision_start|>"],
                vision_end_token_id=ids["<|vision_end|>"],
                image_token_id=ids["<|image_pad|>"],
                video_token_id=ids["<|video_pad|>"],
                tie_word_embeddings=False,
                architectures=[_ARCH_CLASS[arch]],
            )
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
