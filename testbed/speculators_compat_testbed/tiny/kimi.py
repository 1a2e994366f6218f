"""Tiny checkpoints: Kimi-K2.5 as released (moonshotai/Kimi-K2.5).

Its config is no transformers class in every release, so the checkpoint is written here:
the remote-code files (config and vision-chunk image processor stand-ins), the image processor's
``media_proc_cfg``, the MoonViT vision tower / projector tensor shapes, how overrides split
between the wrapper config and ``text_config``, and :func:`_build_kimi_k25` (text decoder shapes
from transformers' DeepSeek-V3, every tensor from its per-name seed). Its config dict lives in
:mod:`.configs` (``_kimi_k25_config``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .configs import _KIMI_MEDIA_TOKENS, SEED, VOCAB_SIZE, _make_config
from .tokenizer import _build_tokenizer
from .weights import _init_tensor

# Which overrides go to the wrapper config; every other key goes to text_config (MLA dims,
# routing, llama_4_scaling: the DeepSeek-V3 decoder reads them there).
_KIMI_WRAPPER_KEYS = ("vision_config", "media_placeholder_token_id", "image_token_id", "use_unified_vision_chunk")


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
