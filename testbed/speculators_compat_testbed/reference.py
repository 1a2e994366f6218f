"""HF transformers reference for captured per-layer hidden states.

speculators' ``VllmHiddenStatesGenerator`` captures, after decoder layer i, the residual
stream (``hidden_states + residual``) *before* the final norm.  HF's
``output_hidden_states[-1]`` has the final norm applied, so the reference is taken from
forward hooks on the decoder layers instead (for non-last layers the two agree).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

__all__ = [
    "ROW_TOLERANCE",
    "TOLERANCE",
    "CompareReport",
    "compare",
    "decoder_layers",
    "hf_layer_outputs",
    "load_hf_model",
    "relative_error",
    "router_logits",
    "router_margins",
    "row_errors",
    "MARGIN_TIE",
    "EXPLAINED_CAP",
]

# Relative Frobenius error allowed between a capture and the HF reference, by compute dtype.
# bf16 keeps 8 mantissa bits (2^-9 ~ 2e-3 relative rounding per operation); two correct bf16
# implementations with different kernels drift apart layer by layer. Measured on the tiny
# 4-layer models: 1.2-1.4e-2 on vLLM 0.14-0.32 (CPU) and 0.24 (H200), 2.0-2.3e-2 at the last
# layer on vLLM 0.11/0.12's CPU kernels - uniform over tokens. Sequences in the wrong order give
# ~1 (measured 1.2-1.4 for Model Runner V2's reordering); ONE wrong row in 2,000 does not move
# this figure past the tolerance - ROW_TOLERANCE below catches that. float32: 1e-4.
TOLERANCE: dict[str, float] = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3}

# Bound on EVERY row (token) of every (sequence, layer): ||c_i - r_i|| / ||r_i||. The Frobenius
# figure above averages over ~2,000 rows, so one wrong row moves it by ~1/sqrt(2000) only (a row
# copied from its neighbour: 3e-2, a zeroed row: 2.2e-2 - both under 3e-2); this bound does not.
# Measured with the e2e runner (speculators 0.4.0.1, vLLM 0.32.0 CPU, layers 1-3 of the tiny
# 4-layer models, all 23 sequences = 47,151 rows per arch, bf16 vs HF bf16):
#   correct rows       llama p50 9.2e-3  p99 1.4e-2  p99.9 1.7e-2  max 2.26e-2
#                      qwen3 p50 1.0e-2  p99 1.6e-2  p99.9 1.8e-2  max 2.43e-2
#   wrong rows         zeroed row: 1.0 exactly; the reference row of the next/previous token in
#                      its place (a duplicated or shifted row) where the two tokens differ:
#                      llama min 0.40 (p0.1 0.52, median 1.26), qwen3 min 0.47 (median 1.28)
# 0.1 sits 4x above the worst correct row and 4x below the closest wrong row. (Where two
# neighbouring tokens are the same id, ~1 in 1,000 random positions, their rows are close -
# 0.014 to 0.38 apart - and a swap of the two is not a wrong answer the check could see.)
# float32 (same runner, --dtype float32, llama): correct rows p50 6.1e-7, p99.9 1.1e-6, max 1.4e-6;
# wrong rows (neighbour, distinct tokens) min 0.40. 1e-3 sits ~700x above and ~400x below.
# float16 (no CPU engine computes in it; not measured) scales the bf16 bound by the dtypes'
# rounding (8 vs 11 mantissa bits): 2e-2, still 20x below the closest wrong row.
ROW_TOLERANCE: dict[str, float] = {"float32": 1e-3, "bfloat16": 0.1, "float16": 2e-2}

# Near-tie threshold on a router's top-k margin (router_margins: the k-th selected minus the best
# unselected score, in the units the router selects on - softmax probabilities, or DeepSeek-V3's
# sigmoid + e_score_correction_bias with group-limited top-k), by compute dtype. Derivation: with
# u the dtype's unit roundoff (bf16 2^-8, fp16 2^-11, fp32 2^-24), the router input of two
# correct implementations differs per row by up to ~6u (bf16: measured worst correct row 2.4e-2,
# ROW_TOLERANCE above); a logit of O(1) size then moves by ~6u, a score by at most 1/4 of that
# (d sigmoid/dz = s(1-s) <= 1/4, d p_e/dz_e = p(1-p) <= 1/4): 1.5u, plus the score's own rounding
# 0.5u = 2u per score; the gap between two scores moves by up to twice that: 4u (bf16 2^-6 =
# 1.56e-2). Measured (HF bf16 against HF float32 on the same tiny models, 6,739 tokens): at the
# first MoE layer, where nothing upstream flipped, the selection differs at 52 tokens (qwen3_moe)
# and 71 (deepseek_v3), all at bf16 margins <= 9.1e-3 and <= 1.29e-2; half of all tokens have a
# margin under 1.6e-2 (qwen3_moe) / 3.2e-2 (deepseek_v3) - a near-tie is common, a flip is not.
# Flips at larger margins (up to 0.43) occur only in later layers, downstream of an earlier flip
# (the token's own, or one it attends to); those are NOT explained by this threshold.
MARGIN_TIE: dict[str, float] = {"float32": 4 * 2.0**-24, "bfloat16": 2.0**-6, "float16": 2.0**-9}

# An outlier row at a near-tie token still passes only if it is no wrong row of another kind:
#   - its error is below EXPLAINED_CAP: a zeroed row measures 1.0 exactly; genuine expert flips
#     measured up to 0.908 (qwen3_moe tiny, bf16, vLLM 0.32 CPU vs HF) - they overlap the
#     distance between neighbouring rows (MoE: min 0.43, p0.1 0.53, median 1.08), so the error
#     alone cannot tell a flip from a copied neighbour; the two checks below do;
#   - its norm is within EXPLAINED_NORM_RATIO of the reference row's (flips: 0.88-1.15 measured;
#     a zeroed row 0, a scaled-down row below 0.5);
#   - it is no other token's row: its distance to every OTHER token's reference row and captured
#     row of the same batch and layer (all sequences) exceeds MISPLACED_MATCH[dtype] x that row's
#     norm. A copied, shifted or misplaced row is its source's captured row (distance 0), within the
#     correct-row drift (bf16 <= 2.4e-2) of its source's reference; genuine flips measured >= 5.8e-2
#     from every other token's reference row (qwen3_moe), so 0.05 in bf16.
# bf16 rows of real models: correct rows reached 0.12 against fp32 on a trained 30-layer model,
# where HF's own bf16 forward reached 0.093 on the same rows (high-norm tokens): a fixed bound
# tuned on random weights does not hold there. With the reference's own bf16-vs-fp32 spread of
# each row (``spread``), that row's bound is SPREAD_FACTOR x its spread (two bf16
# implementations: each ~1x apart from fp32), never below ROW_TOLERANCE and never above
# SPREAD_CAP, below the closest wrong row measured (a neighbour's row 0.40, a zeroed row 1.0).
SPREAD_FACTOR = 3.0
SPREAD_CAP = 0.35
# A row whose reference norm exceeds MASSIVE_RATIO x the median of its (sequence, layer) is a
# massive row (a trained model's position 0 holds up to 99 % of a layer's squared norm): the
# Frobenius figure is taken over the other rows (the massive ones would hide their errors),
# massive rows are bounded row by row like every row, and reported apart.
MASSIVE_RATIO = 8.0

EXPLAINED_CAP = 0.95
EXPLAINED_NORM_RATIO = (0.5, 2.0)
MISPLACED_MATCH: dict[str, float] = {"float32": 5e-4, "bfloat16": 0.05, "float16": 1e-2}

_DTYPE_NAMES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, str):
        name = dtype.lower().replace("torch.", "")
    else:
        name = str(dtype).replace("torch.", "")
    if name not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype!r}")
    return _DTYPE_NAMES[name]


def _torch_dtype(dtype: Any):
    import torch

    return getattr(torch, _dtype_name(dtype))


def load_hf_model(model_dir: str | Path, dtype: Any = "float32", device: str = "cpu"):
    """Load a causal LM once, directly in ``dtype`` (no dtype round trips), eager attention,
    eval mode."""
    import transformers
    from transformers import AutoModelForCausalLM

    td = _torch_dtype(dtype)
    kwargs: dict[str, Any] = {"attn_implementation": "eager"}
    from packaging.version import Version

    from speculators_compat.versions import normalize

    if normalize(transformers.__version__) >= Version("4.56"):
        kwargs["dtype"] = td
    else:
        kwargs["torch_dtype"] = td
    model = _wrapper_text_decoder(model_dir, td)
    if model is None:
        model = _with_transformers_own_classes(model_dir, kwargs)
    if model is None:
        try:
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
        except (ValueError, AttributeError) as exc:
            # multimodal wrappers (llava, Kimi-K2.5 on transformers 5, ...) are not causal-LM auto
            # classes, or (Qwen3.5-MoE on transformers 5.17) map to a text class that cannot take the
            # wrapper's config; text-only input ids run their text decoder, whose layers decoder_layers() finds
            if isinstance(exc, AttributeError) and not _is_wrapper(model_dir):
                raise
            from transformers import AutoModelForImageTextToText

            model = AutoModelForImageTextToText.from_pretrained(str(model_dir), **kwargs)
    model.to(device)
    model.eval()
    return model


def _is_wrapper(model_dir: str | Path) -> bool:
    """Whether the checkpoint's config.json nests a ``text_config`` (a multimodal wrapper)."""
    import json

    cfg_path = Path(model_dir) / "config.json"
    return cfg_path.exists() and isinstance(json.loads(cfg_path.read_text()).get("text_config"), dict)


def _wrapper_text_decoder(model_dir: str | Path, torch_dtype):
    """For a multimodal wrapper this transformers has no class for (Kimi-K2.5, model_type
    kimi_k25, on transformers < 5), its text decoder alone: the text_config's causal LM on the
    checkpoint's ``language_model.*`` tensors (every one of them must load). None when the
    wrapper's own class exists (then the caller loads it) or the directory is no such wrapper."""
    import json

    cfg_path = Path(model_dir) / "config.json"
    if not cfg_path.exists():
        return None
    cfg = json.loads(cfg_path.read_text())
    text = cfg.get("text_config")
    from transformers import CONFIG_MAPPING

    # a model CLASS decides, not the config key: vLLM registers its own KimiK25Config under
    # kimi_k25 in transformers' CONFIG_MAPPING, which has no model for it (transformers < 5)
    if not isinstance(text, dict) or _transformers_classes(cfg.get("model_type")) is not None:
        return None
    text_type = text.get("model_type")
    if text_type not in CONFIG_MAPPING and text.get("architectures") == ["DeepseekV3ForCausalLM"]:
        text_type = "deepseek_v3"  # Kimi-K2.5's released text_config says kimi_k2 (transformers < 5 lacks it)
    if text_type not in CONFIG_MAPPING:
        raise ValueError(
            f"{cfg_path}: wrapper model_type {cfg.get('model_type')!r} and its text_config model_type "
            f"{text_type!r} are both unknown to this transformers"
        )
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    text_cfg = AutoConfig.for_model(text_type, **{k: v for k, v in text.items() if k != "model_type"})
    for k, v in text.items():  # keys some versions do not take as constructor arguments
        if k not in ("model_type", "rope_theta", "rope_scaling") and not hasattr(text_cfg, k):
            setattr(text_cfg, k, v)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        model = AutoModelForCausalLM.from_config(text_cfg, attn_implementation="eager")
    finally:
        torch.set_default_dtype(prev)
    state = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key.startswith("language_model."):
                    state[key[len("language_model."):]] = f.get_tensor(key)
    if not state:
        raise ValueError(f"{model_dir}: no language_model.* tensors for the text decoder of {cfg.get('model_type')!r}")
    model.load_state_dict(state, strict=True)  # every decoder tensor, no stray one
    return model.to(torch_dtype)


_MODEL_TABLES = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
                 "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES")


def _transformers_classes(model_type):
    """(config class, model class) transformers itself defines for ``model_type`` (a causal LM,
    else an image-text-to-text or multimodal LM), or None."""
    import transformers
    from transformers.models.auto import configuration_auto, modeling_auto

    config_name = configuration_auto.CONFIG_MAPPING_NAMES.get(model_type)
    for table in _MODEL_TABLES:
        model_name = getattr(modeling_auto, table, {}).get(model_type)
        if config_name and isinstance(model_name, str):
            config_cls, model_cls = getattr(transformers, config_name, None), getattr(transformers, model_name, None)
            takes = getattr(model_cls, "config_class", None)
            # a class of another config (Qwen3.5-MoE's causal LM takes the text config alone): the next table
            if config_cls is not None and model_cls is not None and (takes is None or issubclass(config_cls, takes)):
                return config_cls, model_cls
    return None


def _with_transformers_own_classes(model_dir: str | Path, kwargs: dict):
    """The checkpoint loaded with transformers' own config and model classes where another
    library registered its config class over transformers' for that model_type (vLLM registers
    its KimiK25Config under ``kimi_k25``; transformers 5 has ``Kimi_K25Config`` and
    ``Kimi_K25ForConditionalGeneration``, and the Auto classes refuse the foreign config). None
    where the Auto classes see transformers' own config class (the caller loads as usual)."""
    import json

    from transformers import CONFIG_MAPPING

    cfg_path = Path(model_dir) / "config.json"
    if not cfg_path.exists():
        return None
    model_type = json.loads(cfg_path.read_text()).get("model_type")
    classes = _transformers_classes(model_type)
    if classes is None or model_type not in CONFIG_MAPPING:
        return None
    config_cls, model_cls = classes
    if CONFIG_MAPPING[model_type] is config_cls:
        return None
    config = config_cls.from_pretrained(str(model_dir))
    return model_cls.from_pretrained(str(model_dir), config=config, **kwargs)


def decoder_layers(model) -> Sequence:
    """The decoder layer list of a (possibly multimodal) causal LM."""
    import torch

    candidates = []
    base = getattr(model, "model", None)
    if base is not None:
        candidates += [base, getattr(base, "language_model", None), getattr(base, "text_model", None)]
        lm = getattr(base, "language_model", None)
        if lm is not None:
            candidates.append(getattr(lm, "model", None))
    candidates.append(getattr(model, "language_model", None))
    if hasattr(model, "get_decoder"):
        try:
            candidates.append(model.get_decoder())
        except Exception:  # noqa: BLE001 - a model whose get_decoder fails: its other candidates remain
            pass
    for c in candidates:
        layers = getattr(c, "layers", None) if c is not None else None
        if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
            return layers
    raise ValueError(f"cannot find decoder layers in {type(model).__name__}")


def hf_layer_outputs(
    model_dir: str | Path | Any,
    sequences: list[list[int]],
    layer_ids: list[int],
    dtype: Any = "float32",
    device: str = "cpu",
    margins: list | None = None,
) -> list[list["torch.Tensor"]]:  # noqa: F821
    """Residual stream after each decoder layer in ``layer_ids`` for each sequence.

    With ``margins`` (a list), one dict per sequence is appended to it: ``{decoder layer index:
    float32 tensor [len]}`` of the router top-k margin (:func:`router_margins`) of every MoE
    layer of the model, computed from the router logits the reference's own forward produced.

    ``model_dir`` may also be an already loaded model (from :func:`load_hf_model`).
    Sequences are run one at a time (batch 1, no padding).  Returns ``result[s][k]``: a CPU
    tensor ``[len(sequences[s]), hidden]`` in the model dtype, for ``layer_ids[k]``; the last
    layer's output is *not* final-normed.
    """
    import torch

    if isinstance(model_dir, (str, Path)):
        model = load_hf_model(model_dir, dtype=dtype, device=device)
    else:
        model = model_dir
    layers = decoder_layers(model)
    n = len(layers)
    for i in layer_ids:
        if not -n <= i < n:
            raise IndexError(f"layer id {i} out of range for {n} layers")
    wanted = sorted({i % n for i in layer_ids})
    captured: dict[int, torch.Tensor] = {}

    def make_hook(idx: int):
        def hook(_module, _args, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            captured[idx] = out.detach()

        return hook

    handles = [layers[i].register_forward_hook(make_hook(i)) for i in wanted]
    logits: dict[int, torch.Tensor] = {}
    routers = {}
    if margins is not None:
        for i, layer in enumerate(layers):
            got = _hf_router(layer)
            if got is None:
                continue
            gate, spec = got
            routers[i] = (gate, spec)

            def gate_hook(module, args, output, i=i):
                logits[i] = router_logits(module, args, output)

            handles.append(gate.register_forward_hook(gate_hook))
    dev = next(model.parameters()).device
    results: list[list[torch.Tensor]] = []
    try:
        with torch.no_grad():
            for seq in sequences:
                captured.clear()
                logits.clear()
                ids = torch.tensor([list(seq)], dtype=torch.long, device=dev)
                model(input_ids=ids, use_cache=False)
                if margins is not None:
                    per = {}
                    for i, (gate, spec) in routers.items():
                        bias = getattr(gate, "e_score_correction_bias", None)
                        per[i] = router_margins(logits[i], bias=bias, **spec)
                    margins.append(per)
                row = []
                for i in layer_ids:
                    t = captured[i % n]
                    if t.dim() == 3:
                        t = t[0]
                    row.append(t.to("cpu").clone())
                results.append(row)
    finally:
        for h in handles:
            h.remove()
    return results


# ---------------------------------------------------------------------------------------------
# Router top-k margins (issue #14 item 1): where two correct bf16 implementations pick different
# experts for a token, that token's row differs by far more than rounding. Such a row may pass
# only when the REFERENCE shows the routing decision at that token was a near-tie.

def router_margins(logits, top_k: int, scoring: str = "softmax", bias=None, n_group: int = 1,
                   topk_group: int = 1):
    """Per-token top-k margin of a router, in the units it selects on: ``[tokens]`` float32.

    - ``softmax`` (Qwen3-MoE, Mixtral, gpt-oss-style): probabilities over all experts; margin =
      p(k-th selected) - p(best unselected).
    - ``sigmoid`` (DeepSeek-V3 ``noaux_tc``): choice scores ``sigmoid(z) + e_score_correction_bias``
      with group-limited top-k: groups ranked by the sum of their two best choice scores, the best
      ``topk_group`` groups kept, top-k over the kept experts. The margin is the smaller of
        * the expert margin inside the kept groups (k-th selected - best unselected kept expert), and
        * the group margin (score of the last kept group - best dropped group), counted only where
          swapping those two groups changes the selection: the last kept group holds a selected
          expert, or the best dropped group holds an expert scoring above the k-th selected one.
    """
    import torch

    z = torch.as_tensor(logits).detach().to("cpu", torch.float32)
    z = z.reshape(-1, z.shape[-1])
    n_tok, n_exp = z.shape
    if scoring == "softmax":
        s = torch.softmax(z, dim=-1)
    elif scoring == "sigmoid":
        s = torch.sigmoid(z)
    else:
        raise ValueError(f"unsupported router scoring {scoring!r}")
    if bias is not None:
        s = s + torch.as_tensor(bias).detach().to("cpu", torch.float32).reshape(1, -1)
    if top_k >= n_exp:
        return torch.full((n_tok,), float("inf"))
    n_group = int(n_group or 1)
    topk_group = int(topk_group or n_group)
    if n_group <= 1 or topk_group >= n_group:
        v = s.topk(top_k + 1, dim=-1).values
        return v[:, top_k - 1] - v[:, top_k]
    per = n_exp // n_group
    grouped = s.view(n_tok, n_group, per)
    gscore = grouped.topk(min(2, per), dim=-1).values.sum(-1)  # [T, G]
    gv, gi = gscore.topk(n_group, dim=-1)  # sorted, descending
    kept = torch.zeros(n_tok, n_group, dtype=torch.bool)
    kept.scatter_(1, gi[:, :topk_group], True)
    masked = s.masked_fill(~kept.repeat_interleave(per, dim=1), float("-inf"))
    n_kept = topk_group * per
    if top_k >= n_kept:
        expert_margin = torch.full((n_tok,), float("inf"))
        mv, mi = masked.topk(n_kept, dim=-1)
        kth = mv[:, -1]
    else:
        mv, mi = masked.topk(top_k + 1, dim=-1)
        expert_margin = mv[:, top_k - 1] - mv[:, top_k]
        kth = mv[:, top_k - 1]
    sel_groups = mi[:, :top_k] // per  # group of each selected expert
    last_kept = gi[:, topk_group - 1]
    best_dropped = gi[:, topk_group]
    last_holds_selected = (sel_groups == last_kept[:, None]).any(-1)
    dropped_best_expert = grouped.gather(1, best_dropped[:, None, None].expand(-1, 1, per)).squeeze(1).max(-1).values
    swap_matters = last_holds_selected | (dropped_best_expert > kth)
    group_margin = gv[:, topk_group - 1] - gv[:, topk_group]
    group_margin = torch.where(swap_matters, group_margin, torch.full_like(group_margin, float("inf")))
    return torch.minimum(expert_margin, group_margin)


def router_logits(gate, args, output):
    """A router's logits ``[tokens, experts]`` (float32, CPU) from a forward hook on its gate
    module, for HF's and vLLM's routers alike.

    The gate's output where it is the logits (a Linear; vLLM's ``ReplicatedLinear`` gives
    ``(logits, bias)``; transformers 5's DeepSeek-V3 router). Where the router returns its
    choice instead - transformers 4.57's ``DeepseekV3TopkRouter`` gives ``(topk_indices,
    topk_weights)`` - the logits are recomputed from its input as that router computes them,
    ``F.linear(x.float32, weight.float32, bias)``; the result must then have one column per expert."""
    import torch

    out = output[0] if isinstance(output, (tuple, list)) else output
    weight = getattr(gate, "weight", None)
    if not (torch.is_tensor(weight) and weight.dim() == 2 and weight.numel() > 0):
        # vLLM's CPU linear layers pack their weight elsewhere and leave an empty `weight`
        # (dispatch_cpu_unquantized_gemm, remove_weight): the width comes from the layer's size
        weight = None
    experts = weight.shape[0] if weight is not None else (
        getattr(gate, "output_size", None) or getattr(gate, "out_features", None))
    if torch.is_tensor(out) and out.is_floating_point() and (experts is None or out.shape[-1] == experts):
        return out.detach().reshape(-1, out.shape[-1]).to("cpu", torch.float32).clone()
    if weight is None or not args or not torch.is_tensor(args[0]):
        raise RuntimeError(f"router {type(gate).__qualname__}: its output is not logits and it has no weight/input "
                           f"to recompute them from (got {type(out).__name__})")
    x = args[0].detach()
    bias = getattr(gate, "bias", None)
    bias = bias.detach().to(torch.float32) if torch.is_tensor(bias) and bias.numel() else None
    z = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]).to(torch.float32), weight.detach().to(torch.float32), bias)
    return z.to("cpu").clone()


def _hf_router(layer):
    """(gate module, spec) of an HF decoder layer's MoE router, or None for a dense layer."""
    mlp = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)
    gate = getattr(mlp, "gate", None) if mlp is not None else None
    if gate is None or getattr(mlp, "experts", None) is None:
        return None
    top_k = getattr(gate, "top_k", None) or getattr(mlp, "top_k", None)
    if top_k is None:
        return None
    bias = getattr(gate, "e_score_correction_bias", None)
    n_group = getattr(gate, "num_group", None) or getattr(gate, "n_group", None) or 1
    spec = {"top_k": int(top_k), "scoring": "sigmoid" if bias is not None else "softmax",
            "n_group": int(n_group), "topk_group": int(getattr(gate, "topk_group", None) or n_group)}
    return gate, spec


def relative_error(a, b) -> float:
    """||a - b||_F / max(||b||_F, tiny), in float32."""
    import torch

    a = torch.as_tensor(a).detach().to("cpu", torch.float32)
    b = torch.as_tensor(b).detach().to("cpu", torch.float32)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch {tuple(a.shape)} vs {tuple(b.shape)}")
    num = torch.linalg.vector_norm(a - b).item()
    den = max(torch.linalg.vector_norm(b).item(), torch.finfo(torch.float32).tiny)
    return num / den


def _own_row(c, r, i: int) -> bool:
    """Whether captured row ``c[i]`` is nearer its own reference row ``r[i]`` than every other row
    of ``r`` and has a norm within EXPLAINED_NORM_RATIO of it (a copied, shifted or scaled row is not)."""
    import torch

    norm_r = float(torch.linalg.vector_norm(r[i]))
    ratio = float(torch.linalg.vector_norm(c[i])) / max(norm_r, 1e-30)
    if not EXPLAINED_NORM_RATIO[0] <= ratio <= EXPLAINED_NORM_RATIO[1]:
        return False
    d = torch.linalg.vector_norm(r - c[i], dim=-1)
    own = float(d[i])
    d[i] = float("inf")
    return own < float(d.min()) if d.numel() > 1 else True


def _row_errors(a, b):
    """Per-token (row) relative errors ``||a_i - b_i|| / ||b_i||`` of two [len, hidden] tensors,
    float32 (NaN/inf in ``a`` give NaN/inf, never a pass)."""
    import torch

    a = torch.as_tensor(a).detach().to("cpu", torch.float32).reshape(-1, a.shape[-1])
    b = torch.as_tensor(b).detach().to("cpu", torch.float32).reshape(-1, b.shape[-1])
    den = torch.linalg.vector_norm(b, dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.linalg.vector_norm(a - b, dim=-1) / den


row_errors = _row_errors


@dataclass
class CompareReport:
    """Errors of a capture against the reference.

    Two bounds, both must hold for every (sequence, layer):

    - ``errors[s][k]``: relative Frobenius error of sequence s, layer_ids[k] <= ``tolerance``;
    - every row (token) of it: ``||c_i - r_i|| / ||r_i|| <= row_tolerance``.
      ``worst_rows[s][k]`` = ``[row, error]`` of its worst row, ``rows_over[s][k]`` = how many
      rows exceed the bound.

    There is no allowance by count: one zeroed, misplaced, duplicated or shifted row fails.
    """

    dtype: str
    tolerance: float
    row_tolerance: float
    errors: list[list[float]] = field(default_factory=list)  # errors[seq][k]
    worst_rows: list[list[list]] = field(default_factory=list)  # [row index, row error] per (seq, k)
    rows_over: list[list[int]] = field(default_factory=list)
    row_quantiles: dict = field(default_factory=dict)  # over all rows of all (seq, k)
    problems: list[str] = field(default_factory=list)  # shape mismatches, missing entries
    # Router near-ties (issue #14): only when the reference's router margins were given.
    margin_tie: float | None = None  # near-tie threshold (MARGIN_TIE) in force, None: no margins
    explained: list[dict] = field(default_factory=list)  # rows over the bound, explained by a near-tie
    unexplained: list[dict] = field(default_factory=list)  # rows over the bound, not explained (why)
    errors_unexplained: list[list[float]] = field(default_factory=list)  # Frobenius without explained rows
    worst_unexplained: list[list[list]] = field(default_factory=list)  # [row, error] per (seq, k)
    margin_quantiles: dict = field(default_factory=dict)  # of the per-token min margin over MoE layers
    massive_rows: dict = field(default_factory=dict)  # rows over MASSIVE_RATIO x the median norm
    massive_errors: list[list[float]] = field(default_factory=list)  # Frobenius over the massive rows, per (seq, k)
    spread_allowed: dict = field(default_factory=dict)  # rows whose spread bound exceeds row_tolerance

    def _ok(self, s: int, k: int) -> bool:
        if self.margin_tie is None:
            e = self.errors[s][k]
            _, w = self.worst_rows[s][k]
            over = self.rows_over[s][k]
        else:  # explained rows are judged one by one (compare()); the rest as always
            e = self.errors_unexplained[s][k]
            _, w = self.worst_unexplained[s][k]
            over = sum(1 for u in self.unexplained if u["sequence"] == s and u["layer_index"] == k)
            if self.rows_over[s][k] < 0:
                over = -1
        # with a spread, rows_over counts each row against its own bound (<= SPREAD_CAP)
        worst_bound = self.row_tolerance if not self.spread_allowed else max(self.row_tolerance, SPREAD_CAP)
        me = self.massive_errors[s][k] if s < len(self.massive_errors) and k < len(self.massive_errors[s]) else 0.0
        return (
            math.isfinite(e) and e <= self.tolerance
            and math.isfinite(me) and me <= self.tolerance
            and w is not None and math.isfinite(w) and w <= worst_bound
            and over == 0
        )

    @property
    def max_error(self) -> float:
        vals = [e for row in self.errors for e in row]
        if any(not math.isfinite(v) for v in vals):
            return float("nan")
        return max(vals) if vals else 0.0

    @property
    def worst_row(self) -> dict | None:
        """``{"sequence", "layer_index", "row", "error"}`` of the worst row over everything
        (``layer_index`` indexes the compared layer list)."""
        best, best_key = None, -1.0
        for s, per_k in enumerate(self.worst_rows):
            for k, (r, e) in enumerate(per_k):
                key = float("inf") if e is None or not math.isfinite(e) else e
                if key > best_key:
                    best, best_key = {"sequence": s, "layer_index": k, "row": r, "error": e}, key
        return best

    @property
    def passed(self) -> bool:
        if self.problems:
            return False
        return all(self._ok(s, k) for s, row in enumerate(self.errors) for k in range(len(row)))

    def failures(self) -> list[tuple[int, int, float]]:
        return [
            (s, k, e)
            for s, row in enumerate(self.errors)
            for k, e in enumerate(row)
            if not self._ok(s, k)
        ]

    def as_dict(self) -> dict:
        return {
            "dtype": self.dtype, "tolerance": self.tolerance, "row_tolerance": self.row_tolerance,
            "passed": self.passed, "max_error": self.max_error, "worst_row": self.worst_row,
            "errors": self.errors, "worst_rows": self.worst_rows, "rows_over": self.rows_over,
            "row_quantiles": self.row_quantiles, "problems": self.problems,
            "margin_tie": self.margin_tie, "explained_rows": self.explained,
            "unexplained_rows": self.unexplained, "errors_unexplained": self.errors_unexplained,
            "margin_quantiles": self.margin_quantiles,
            "massive_rows": self.massive_rows, "massive_errors": self.massive_errors,
            "spread_allowed": self.spread_allowed,
        }

    def summary(self) -> str:
        status = "PASS" if self.passed else "FAIL"
        w = self.worst_row
        worst = (f"; worst row {w['error']:.3e} (seq {w['sequence']} layer#{w['layer_index']} row {w['row']},"
                 f" row bound {self.row_tolerance:.1e})") if w else ""
        lines = [f"{status}: max relative error {self.max_error:.3e} (tolerance "
                 f"{self.tolerance:.1e}, {self.dtype}){worst}"]
        lines += [f"  {p}" for p in self.problems]
        if self.margin_tie is not None:
            lines.append(
                f"  rows over {self.row_tolerance:.1e}: {len(self.explained)} explained by a router near-tie"
                f" (margin < {self.margin_tie:.2e} at an MoE layer at or before), {len(self.unexplained)} unexplained"
            )
            for x in self.explained[:10]:
                lines.append(f"    explained: seq {x['sequence']} layer {x['layer']} row {x['row']}: {x['error']:.3e},"
                             f" margin {x['margin']:.2e} at layer {x['margin_layer']}")
            if len(self.explained) > 10:
                lines.append(f"    ... {len(self.explained) - 10} more explained rows")
            for x in self.unexplained[:10]:
                lines.append(f"    UNEXPLAINED: seq {x['sequence']} layer {x['layer']} row {x['row']}: {x['error']:.3e},"
                             f" margin {x['margin']:.2e}: {x['why']}")
        for s, k, e in self.failures():
            r, re_ = self.worst_rows[s][k]
            lines.append(
                f"  seq {s} layer#{k}: {e:.3e}; {self.rows_over[s][k]} rows over {self.row_tolerance:.1e},"
                f" worst row {r}: {re_:.3e}" if re_ is not None else f"  seq {s} layer#{k}: {e:.3e}"
            )
        return "\n".join(lines)

    def __bool__(self) -> bool:
        return self.passed


def compare(
    captured,
    reference,
    dtype: Any = "float32",
    tolerance: float | None = None,
    row_tolerance: float | None = None,
    margins: list | None = None,
    layer_ids: Sequence[int] | None = None,
    margin_tie: float | None = None,
    token_ids: list | None = None,
    spread: list | None = None,
) -> CompareReport:
    """Compare ``captured[seq][k]`` with ``reference[seq][k]`` (both ``[len, hidden]``): the
    Frobenius error per (sequence, layer) and every row's own error (see :class:`CompareReport`).

    ``captured[seq]`` may also be a single tensor ``[len, n_layers, hidden]`` or
    ``[n_layers, len, hidden]`` stacked per sequence; it is split along the layer axis.

    ``margins[seq]`` (``{decoder layer index: tensor [len]}``, from the REFERENCE's routers:
    ``hf_layer_outputs(margins=...)`` or the vLLM own-forward reference) with ``layer_ids`` (the
    decoder layer of each compared k) lets a row over ``row_tolerance`` pass as *explained*, and
    only when all hold (constants and measurements: MARGIN_TIE, EXPLAINED_CAP above):

    - the reference's top-k margin at that token is below ``margin_tie`` (default
      ``MARGIN_TIE[dtype]``) in some MoE layer at or before the compared layer;
    - its error is below EXPLAINED_CAP (a zeroed row, 1.0, fails) and its norm within
      EXPLAINED_NORM_RATIO of the reference row's;
    - it is no other token's row (farther than MISPLACED_MATCH from every other reference row of
      the batch at that layer): copied, shifted or misplaced rows fail. With ``token_ids``
      (per sequence) rows of the same token id are left out of that search: in these tiny models
      a token's rows at two positions are close (measured 0.019-0.05 apart after a flip), and a
      swap of two same-id rows is no wrong answer this check could see anyway.

    ``spread[seq][k]`` (a tensor ``[len]``: the reference's own per-row error against fp32) makes
    each row's bound ``clamp(SPREAD_FACTOR x spread, row_tolerance, SPREAD_CAP)``. Massive rows
    (MASSIVE_RATIO) are left out of the Frobenius figure and reported apart (``massive_rows``).

    Nothing is allowed by count: each explained row is listed (``explained``), every other row over
    the bound fails, and the Frobenius bound then applies to the unexplained rows. Later tokens
    that attend to an explained row get no allowance: their own rows are held to the bounds.
    """
    import torch

    if spread is not None and margins is not None:
        raise ValueError("compare(): spread and margins are not combined (bf16 MoE rows are explained by near-ties)")
    name = _dtype_name(dtype)
    tol = TOLERANCE[name] if tolerance is None else float(tolerance)
    row_tol = ROW_TOLERANCE[name] if row_tolerance is None else float(row_tolerance)
    rep = CompareReport(dtype=name, tolerance=tol, row_tolerance=row_tol)
    if len(captured) != len(reference):
        rep.problems.append(f"{len(captured)} captured sequences vs {len(reference)} reference")
    all_rows = []
    massive_errs: list = []
    allowed_n = allowed_over = spread_refused = 0
    pairs: dict = {}  # (s, k) -> (capture, reference, row errors) for the near-tie pass
    nan = float("nan")
    for s, (cap, ref) in enumerate(zip(captured, reference)):
        ref_list = list(ref)
        if isinstance(cap, torch.Tensor):
            if cap.dim() == 2 and len(ref_list) == 1:
                cap_list = [cap]
            elif cap.dim() == 3 and cap.shape[1] == len(ref_list) and cap.shape[0] == ref_list[0].shape[0]:
                cap_list = list(cap.unbind(1))
            elif cap.dim() == 3 and cap.shape[0] == len(ref_list):
                cap_list = list(cap.unbind(0))
            else:
                rep.problems.append(f"seq {s}: cannot split captured shape {tuple(cap.shape)}")
                rep.errors.append([nan] * len(ref_list))
                rep.worst_rows.append([[None, nan] for _ in ref_list])
                rep.rows_over.append([-1] * len(ref_list))
                rep.massive_errors.append([0.0] * len(ref_list))
                continue
        else:
            cap_list = list(cap)
        if len(cap_list) != len(ref_list):
            rep.problems.append(f"seq {s}: {len(cap_list)} captured layers vs {len(ref_list)}")
        row, worst_row, over_row, massive_row = [], [], [], []
        for k, (c, r) in enumerate(zip(cap_list, ref_list)):
            if tuple(c.shape) != tuple(r.shape):
                rep.problems.append(f"seq {s} layer#{k}: shape {tuple(c.shape)} vs {tuple(r.shape)}")
                row.append(nan)
                worst_row.append([None, nan])
                over_row.append(-1)
                massive_row.append(0.0)
                continue
            rows = _row_errors(c, r)
            norms = torch.linalg.vector_norm(r.detach().to("cpu", torch.float32).reshape(-1, r.shape[-1]), dim=-1)
            med = norms.median() if norms.numel() else None
            massive = norms > MASSIVE_RATIO * med if med is not None and float(med) > 0 else torch.zeros_like(norms, dtype=torch.bool)
            c2, r2 = c.reshape(-1, c.shape[-1]), r.reshape(-1, r.shape[-1])
            massive_fro = 0.0
            if bool(massive.any()) and not bool(massive.all()):
                row.append(relative_error(c2[~massive], r2[~massive]))
                massive_fro = relative_error(c2[massive], r2[massive])  # held to the same tolerance, apart
                massive_errs.append(rows[massive])
            else:
                row.append(relative_error(c, r))
            massive_row.append(massive_fro)
            bound = torch.full_like(rows, row_tol)
            if spread is not None:
                sp = torch.as_tensor(spread[s][k]).to("cpu", torch.float32).reshape(-1)
                if sp.shape != rows.shape:
                    rep.problems.append(f"seq {s} layer#{k}: spread of {tuple(sp.shape)} rows vs {tuple(rows.shape)}")
                else:
                    bound = (SPREAD_FACTOR * torch.nan_to_num(sp, nan=0.0)).clamp(min=row_tol, max=max(row_tol, SPREAD_CAP))
                    wider = bound > row_tol
                    allowed_n += int(wider.sum())
                    only = (wider & (rows > row_tol) & (rows <= bound)).nonzero().flatten().tolist()
                    for i in only:  # a row the spread alone lets pass must still be its own token's row
                        if not _own_row(c2.float(), r2.float(), i):
                            bound[i] = row_tol
                            spread_refused += 1
                        else:
                            allowed_over += 1
            pairs[(s, k)] = (c, r, rows)
            if rows.numel():
                bad = ~(rows <= bound)  # NaN counts as bad
                finite = torch.nan_to_num(rows, nan=float("inf"))
                i = int(torch.argmax(finite))
                worst_row.append([i, float(rows[i])])
                over_row.append(int(bad.sum()))
                all_rows.append(rows)
            else:
                worst_row.append([None, 0.0])
                over_row.append(0)
        rep.errors.append(row)
        rep.worst_rows.append(worst_row)
        rep.rows_over.append(over_row)
        rep.massive_errors.append(massive_row)
    if all_rows:
        flat = torch.nan_to_num(torch.cat(all_rows), nan=float("inf"))
        qs = torch.quantile(flat[:1_000_000].double(), torch.tensor([0.5, 0.99, 0.999], dtype=torch.float64))
        rep.row_quantiles = {
            "rows": int(flat.numel()), "p50": float(qs[0]), "p99": float(qs[1]), "p99.9": float(qs[2]),
            "max": float(flat.max()),
        }
    if massive_errs:
        m = torch.nan_to_num(torch.cat(massive_errs), nan=float("inf"))
        rep.massive_rows = {"ratio": MASSIVE_RATIO, "rows": int(m.numel()), "max": float(m.max())}
    if spread is not None:
        rep.spread_allowed = {"factor": SPREAD_FACTOR, "cap": SPREAD_CAP, "rows_bound_above_row_tolerance": allowed_n,
                              "rows_passing_only_by_spread": allowed_over,
                              "rows_refused_as_another_tokens_row": spread_refused}
    if margins is not None:
        _explain(rep, pairs, margins, layer_ids, name,
                 MARGIN_TIE[name] if margin_tie is None else float(margin_tie), token_ids)
    return rep


def _batch_rows(rep: CompareReport, pairs: dict, k: int, n_seq: int, token_ids: list | None):
    """Every reference and captured row of the batch at compared layer ``k`` (where a wrong row may
    come from), each sequence's first row's offset, and the token ids (None when they do not fit)."""
    import torch

    present = [t for t in range(n_seq) if (t, k) in pairs]
    allref = torch.cat([pairs[(t, k)][1].detach().to("cpu", torch.float32) for t in present])
    allcap = torch.cat([pairs[(t, k)][0].detach().to("cpu", torch.float32) for t in present])
    offsets, at = {}, 0
    for t in present:
        offsets[t] = at
        at += pairs[(t, k)][1].shape[0]
    all_ids = None
    if token_ids is not None:
        all_ids = torch.cat([torch.as_tensor(list(token_ids[t]), dtype=torch.long) for t in present])
        if all_ids.shape[0] != allref.shape[0]:
            rep.problems.append(f"layer#{k}: {all_ids.shape[0]} token ids for {allref.shape[0]} rows")
            all_ids = None
    return allref, allcap, offsets, all_ids


def _nearest_other(cf, over: list, allref, allcap, own_offset: int, all_ids):
    """For each captured row ``cf[i]`` (i in ``over``): the distance to the nearest row of another
    token, reference or capture (a copy of a neighbour's captured row - itself a flipped row,
    possibly - is the same tensor as that row); rows of the same token id do not count."""
    import torch

    out = []
    for i in over:
        d = torch.minimum(torch.linalg.vector_norm(allref - cf[i], dim=-1),
                          torch.linalg.vector_norm(allcap - cf[i], dim=-1))
        d[own_offset + i] = float("inf")
        if all_ids is not None:
            d[all_ids == all_ids[own_offset + i]] = float("inf")
        out.append(d.min())  # float32, divided by the row norm as before (min commutes with it)
    return out


def _explain(rep: CompareReport, pairs: dict, margins: list, layer_ids, dtype_name: str, tie: float,
             token_ids: list | None = None) -> None:
    """The near-tie pass of :func:`compare` (see there)."""
    import torch

    if layer_ids is None:
        raise ValueError("compare(margins=...) needs layer_ids (the decoder layer of each compared k)")
    rep.margin_tie = tie
    match = MISPLACED_MATCH[dtype_name]
    lo, hi = EXPLAINED_NORM_RATIO
    n_seq = len(rep.errors)
    if len(margins) != n_seq:
        rep.problems.append(f"{len(margins)} margin entries for {n_seq} sequences")
    mins_all = []
    for s in range(min(n_seq, len(margins))):
        per = {int(j): torch.as_tensor(t, dtype=torch.float32) for j, t in (margins[s] or {}).items()}
        if per:
            mins_all.append(torch.stack(list(per.values())).min(0).values)
    if mins_all:
        flat = torch.cat(mins_all)
        fin = flat[torch.isfinite(flat)]
        if fin.numel():
            qs = torch.quantile(fin[:1_000_000].double(), torch.tensor([0.001, 0.01, 0.1, 0.5], dtype=torch.float64))
            rep.margin_quantiles = {"tokens": int(flat.numel()), "min": float(fin.min()), "p0.1": float(qs[0]),
                                    "p1": float(qs[1]), "p10": float(qs[2]), "p50": float(qs[3]),
                                    "below_tie": int((flat < tie).sum())}
    batch_rows: dict = {}  # k -> every row of the batch at that layer (built once per layer)
    for s, per_k in enumerate(rep.errors):
        rep.errors_unexplained.append(list(per_k))
        rep.worst_unexplained.append([list(w) for w in rep.worst_rows[s]])
        per = {}
        if s < len(margins):
            per = {int(j): torch.as_tensor(t, dtype=torch.float32) for j, t in (margins[s] or {}).items()}
        for k in range(len(per_k)):
            if (s, k) not in pairs:
                continue
            c, r, rows = pairs[(s, k)]
            over = torch.nonzero(~(rows <= rep.row_tolerance)).flatten().tolist()
            if not over:
                continue
            layer = int(layer_ids[k])
            moe = sorted(j for j in per if j <= layer)
            if moe:
                stack = torch.stack([per[j] for j in moe])  # [n_moe, len]
                if stack.shape[1] != rows.shape[0]:
                    rep.problems.append(f"seq {s}: margins for {stack.shape[1]} tokens, {rows.shape[0]} rows")
                    moe = []
            cf = c.detach().to("cpu", torch.float32)
            rf = r.detach().to("cpu", torch.float32)
            if k not in batch_rows:
                batch_rows[k] = _batch_rows(rep, pairs, k, n_seq, token_ids)
            allref, allcap, offsets, all_ids = batch_rows[k]
            own_offset = offsets[s]
            nearest_d = _nearest_other(cf, over, allref, allcap, own_offset, all_ids)
            keep = torch.ones(rows.shape[0], dtype=torch.bool)
            for n_i, i in enumerate(over):
                err = float(rows[i])
                entry = {"sequence": s, "layer_index": k, "layer": layer, "row": i, "error": err}
                if moe:
                    col = stack[:, i]
                    j = int(torch.argmin(col))
                    entry["margin"], entry["margin_layer"] = float(col[j]), moe[j]
                else:
                    entry["margin"], entry["margin_layer"] = float("inf"), None
                nr = float(torch.linalg.vector_norm(rf[i])) or torch.finfo(torch.float32).tiny
                ratio = float(torch.linalg.vector_norm(cf[i])) / nr
                nearest = float(nearest_d[n_i] / nr)
                entry["norm_ratio"], entry["nearest_other_row"] = ratio, nearest
                why = []
                if not moe:
                    why.append("no MoE layer at or before this layer")
                elif not entry["margin"] < tie:
                    why.append(f"margin {entry['margin']:.2e} >= {tie:.2e}")
                if not (math.isfinite(err) and err < EXPLAINED_CAP):
                    why.append(f"error {err:.3f} >= cap {EXPLAINED_CAP}")
                if not lo <= ratio <= hi:
                    why.append(f"norm ratio {ratio:.3f} outside [{lo}, {hi}]")
                if not nearest > match:
                    why.append(f"matches another token's reference or captured row ({nearest:.3e} <= {match})")
                if why:
                    entry["why"] = "; ".join(why)
                    rep.unexplained.append(entry)
                else:
                    rep.explained.append(entry)
                    keep[i] = False
            if not bool(keep.all()):
                rep.errors_unexplained[s][k] = relative_error(cf[keep], rf[keep]) if bool(keep.any()) else 0.0
                rest = torch.nan_to_num(rows.masked_fill(~keep, -1.0), nan=float("inf"))
                i = int(torch.argmax(rest))
                rep.worst_unexplained[s][k] = [i, float(rows[i])] if keep.any() else [None, 0.0]
