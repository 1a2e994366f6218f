"""Shrink a released model's config.json to a few layers and small widths, same architecture.

One rule per config field family, applied to the text decoder's config (the file itself or its
``text_config``); each rule returns what it changed, so the rehearsal can say what it ran.
Kept as published: ``model_type``/``architectures``, head_dim, MLA ranks, rope scaling, routing
(``scoring_func``, ``topk_method``, top-k, groups, shared experts), tied embeddings, the pattern of
``layer_types``. Shrunk: depth, widths, expert counts, windows below the rehearsal's prompt lengths.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

HIDDEN = 256  # the shrunk residual width where the config names head_dim (or uses MLA)
HEADS = 4
INTERMEDIATE = 512
EXPERT_INTERMEDIATE = 128
MIN_EXPERTS = 8
VOCAB = 1024  # without the user's tokenizer: the stand-in tokenizer's vocabulary
MIN_LAYERS = 4
WINDOW = 128  # below the rehearsal's long prompts (300-1,300 tokens): the window is exercised
L4_SCALING_ORIGINAL = 256  # llama_4_scaling's threshold, below the long prompts
VISION = {"num_hidden_layers": 1, "depth": 1, "hidden_size": 64, "embed_dim": 64, "intermediate_size": 128,
          "num_attention_heads": 2, "num_heads": 2}

_EXPERT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")
_TOKEN_ID_SUFFIXES = ("_token_id", "_token_index")


class ShrinkError(ValueError):
    """A config this shrink cannot read (the message is one line naming the field)."""


@dataclass
class Shrunk:
    config: dict  # the whole config.json to write
    text: dict  # its text decoder's part (the same object as config or config["text_config"])
    layers: int  # published depth
    layer_map: dict[int, int]  # user's layer id -> shrunk layer id
    changes: list[str] = field(default_factory=list)  # "field: published -> shrunk"
    dropped: list[str] = field(default_factory=list)  # what the shrink leaves out (not covered)


def text_config(cfg: dict) -> dict:
    """The text decoder's config: ``text_config`` of a multimodal wrapper, else the config."""
    tc = cfg.get("text_config")
    return tc if isinstance(tc, dict) else cfg


def layer_kinds(tc: dict) -> list[str]:
    """Each published layer's attention kind: ``layer_types`` as published, or derived from
    ``full_attention_interval`` (Qwen3-Next/3.5) or ``sliding_window_pattern`` (Gemma 3)."""
    n = _int(tc, "num_hidden_layers")
    if isinstance(tc.get("layer_types"), list) and len(tc["layer_types"]) >= n:
        return list(tc["layer_types"][:n])
    if tc.get("full_attention_interval"):
        k = int(tc["full_attention_interval"])
        return ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(n)]
    if tc.get("sliding_window_pattern") and tc.get("sliding_window"):
        k = int(tc["sliding_window_pattern"])
        return ["full_attention" if (i + 1) % k == 0 else "sliding_attention" for i in range(n)]
    return ["full_attention"] * n


def shrunk_depth(tc: dict, n_layer_ids: int = 0) -> int:
    """Enough layers for every published layer kind to appear once, for a dense and a MoE layer
    (``first_k_dense_replace`` becomes 1), and for the layer ids asked for; at least 4."""
    n = _int(tc, "num_hidden_layers")
    kinds = layer_kinds(tc)
    seen: set[str] = set()
    need = 1
    for i, kind in enumerate(kinds):
        if kind not in seen:
            seen.add(kind)
            need = i + 1
    if tc.get("first_k_dense_replace"):
        need = max(need, 2)
    return min(n, max(MIN_LAYERS, need, n_layer_ids))


def map_layer_ids(ids: list[int], published: int, shrunk: int) -> dict[int, int]:
    """Each id in ``0..published`` onto ``0..shrunk`` in proportion, the last layer onto the last,
    order and distinctness kept."""
    for i in ids:
        if not 0 <= i < published:
            raise ShrinkError(f"layer id {i} is outside the model's {published} layers (0..{published - 1})")
    distinct = sorted(set(ids))
    if len(distinct) > shrunk:
        raise ShrinkError(f"{len(distinct)} distinct layer ids need at least {len(distinct)} layers")
    scale = (shrunk - 1) / max(1, published - 1)
    mapped = [min(shrunk - 1, round(i * scale)) for i in distinct]
    for k in range(1, len(mapped)):  # push duplicates up, then pull back below the top
        mapped[k] = max(mapped[k], mapped[k - 1] + 1)
    for k in range(len(mapped) - 1, -1, -1):
        mapped[k] = min(mapped[k], shrunk - 1 - (len(mapped) - 1 - k))
    return dict(zip(distinct, mapped))


def shrink(cfg: dict, layer_ids: list[int] | None = None, *, keep_vocab: bool = False) -> Shrunk:
    """The shrunk copy of ``cfg`` (a config.json dict); ``layer_ids`` on the published depth."""
    out = copy.deepcopy(cfg)
    tc = text_config(out)
    n = _int(tc, "num_hidden_layers")
    depth = shrunk_depth(tc, len(set(layer_ids or ())))
    s = Shrunk(out, tc, n, map_layer_ids(list(layer_ids or ()), n, depth))
    for rule in RULES:
        rule(tc, depth, s)
    if not keep_vocab:
        _vocab(out, tc, s)
    _quantization(out, tc, s)
    if isinstance(out.get("vision_config"), dict):
        _vision(out["vision_config"], s)
    return s


def _set(d: dict, key: str, value: Any, s: Shrunk, where: str = "") -> None:
    if d.get(key) != value:
        s.changes.append(f"{where}{key}: {_short(d.get(key))} -> {_short(value)}")
        d[key] = value


def _short(v: Any) -> str:
    if isinstance(v, list) and len(v) > 6:
        return f"[{', '.join(map(repr, v[:4]))}, ... {len(v)} items]"
    return repr(v)


def _int(d: dict, key: str) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ShrinkError(f"config field {key!r}: expected a positive integer; found {v!r}")
    return v


def rule_depth(tc: dict, depth: int, s: Shrunk) -> None:
    """``num_hidden_layers`` -> the shrunk depth; ``layer_types`` keeps its published prefix."""
    kinds = layer_kinds(tc)
    _set(tc, "num_hidden_layers", depth, s)
    if isinstance(tc.get("layer_types"), list):
        _set(tc, "layer_types", kinds[:depth], s)
    if tc.get("first_k_dense_replace"):
        _set(tc, "first_k_dense_replace", 1, s)
    if isinstance(tc.get("mlp_only_layers"), list):
        _set(tc, "mlp_only_layers", [i for i in tc["mlp_only_layers"] if i < depth], s)


def rule_attention(tc: dict, depth: int, s: Shrunk) -> None:
    """4 query heads; GQA stays GQA (2 kv heads), MQA stays MQA, MHA and MLA stay MHA; head_dim
    as published (it picks the attention kernel), written out where the config derives it."""
    heads = _int(tc, "num_attention_heads")
    kv = tc.get("num_key_value_heads") or heads
    mla = bool(tc.get("kv_lora_rank"))
    head_dim = tc.get("head_dim")
    _set(tc, "num_attention_heads", HEADS, s)
    _set(tc, "num_key_value_heads", HEADS if (mla or kv == heads) else (1 if kv == 1 else 2), s)
    if mla or head_dim:
        _set(tc, "hidden_size", HIDDEN, s)
    else:  # head_dim = hidden_size / heads in this config: keep the published head size
        _set(tc, "hidden_size", HEADS * (_int(tc, "hidden_size") // heads), s)
    if tc.get("linear_num_key_heads"):  # gated delta-net: key/value head ratio kept
        ratio = max(1, int(tc.get("linear_num_value_heads") or tc["linear_num_key_heads"]) // int(tc["linear_num_key_heads"]))
        _set(tc, "linear_num_key_heads", 2, s)
        _set(tc, "linear_num_value_heads", 2 * ratio, s)


def rule_widths(tc: dict, depth: int, s: Shrunk) -> None:
    """MLP widths small; a MoE model without ``moe_intermediate_size`` (gpt-oss) has its experts'
    width in ``intermediate_size``."""
    moe = any(tc.get(k) for k in _EXPERT_KEYS)
    if "intermediate_size" in tc:
        _set(tc, "intermediate_size", EXPERT_INTERMEDIATE if moe and "moe_intermediate_size" not in tc else INTERMEDIATE, s)
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if tc.get(key):
            _set(tc, key, EXPERT_INTERMEDIATE, s)


def rule_experts(tc: dict, depth: int, s: Shrunk) -> None:
    """Experts: twice top-k (at least 8), a multiple of ``n_group`` that leaves ``topk_group``
    groups enough experts for top-k; top-k, groups, scoring and shared experts as published."""
    key = next((k for k in _EXPERT_KEYS if tc.get(k)), None)
    if key is None:
        return
    top_k = int(tc.get("num_experts_per_tok") or tc.get("moe_topk") or 1)
    e = max(MIN_EXPERTS, 2 * top_k)
    groups, topk_group = int(tc.get("n_group") or 1), int(tc.get("topk_group") or 1)
    e = math.ceil(e / groups) * groups
    while topk_group * (e // groups) < top_k:
        e += groups
    _set(tc, key, min(e, int(tc[key])), s)


def rule_windows(tc: dict, depth: int, s: Shrunk) -> None:
    """A sliding window (where used) and ``llama_4_scaling``'s threshold below the rehearsal's
    long prompts, or they are never exercised."""
    window = tc.get("sliding_window")
    if isinstance(window, int) and window > WINDOW and tc.get("use_sliding_window", True) is not False:
        _set(tc, "sliding_window", WINDOW, s)
    l4 = tc.get("llama_4_scaling")
    if isinstance(l4, dict) and int(l4.get("original_max_position_embeddings") or 0) > L4_SCALING_ORIGINAL:
        _set(l4, "original_max_position_embeddings", L4_SCALING_ORIGINAL, s, "llama_4_scaling.")


RULES = (rule_depth, rule_attention, rule_widths, rule_experts, rule_windows)


def _vocab(cfg: dict, tc: dict, s: Shrunk) -> None:
    """Without the user's tokenizer: a 1,024-token vocabulary; BOS 1, EOS 2, PAD 0 (the stand-in
    tokenizer's), every other special token id the config names at the top of the vocabulary."""
    fixed = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    top = VOCAB
    for d, where in ((cfg, ""), (tc, "text_config.")) if tc is not cfg else ((cfg, ""),):
        if "vocab_size" in d:
            _set(d, "vocab_size", VOCAB, s, where)
    specials: dict[int, int] = {}
    for d, where in ((cfg, ""), (tc, "text_config.")) if tc is not cfg else ((cfg, ""),):
        for key in sorted(d):
            if not key.endswith(_TOKEN_ID_SUFFIXES) or d[key] is None:
                continue
            if key in fixed:
                _set(d, key, fixed[key] if not isinstance(d[key], list) else [fixed[key]], s, where)
                continue
            old = d[key]
            if isinstance(old, int) and not isinstance(old, bool):
                if old not in specials:
                    top -= 1
                    specials[old] = top
                _set(d, key, specials[old], s, where)
    s.dropped.append("the tokenizer (none in the folder: a stand-in of 1,024 tokens; special ids remapped)")


def _quantization(cfg: dict, tc: dict, s: Shrunk) -> None:
    for d, where in ((cfg, ""), (tc, "text_config.")):
        q = d.pop("quantization_config", None)
        if q is not None:
            method = q.get("quant_method", "?") if isinstance(q, dict) else "?"
            s.changes.append(f"{where}quantization_config: {method} -> removed")
            s.dropped.append(f"quantized kernels ({method}): the shrunk model runs unquantized")


def _vision(vc: dict, s: Shrunk) -> None:
    """A vision tower of one small layer (vLLM profiles it at start; prompts are text only)."""
    for key, value in VISION.items():
        if isinstance(vc.get(key), int):
            _set(vc, key, value, s, "vision_config.")
