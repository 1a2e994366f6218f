"""A second reference for the e2e cells: the same vLLM engine's own forward, shim disabled.

For configs HF transformers does not implement (DeepSeek-V3 with ``llama_4_scaling``), the
states speculators' generator captures under the shim are compared with what vLLM's own
``model.forward`` computes in a plain ``vllm.LLM`` (``SPECULATORS_COMPAT_DISABLE=1``): forward
hooks on the decoder layers, registered in the worker through ``LLM.apply_model``
(``VLLM_ALLOW_INSECURE_SERIALIZATION=1``), read ``hidden_states + residual`` after each chosen
layer; one prompt at a time (prefill of the prompt, one sampled token, no decode forward).

``"schedule": "generator"`` in the spec: each case's prompts go to the engine in one
``generate`` call with the generator's scheduler settings (token budget, max sequences), so the
engine batches and chunks them as the generator's step loop does and a correct capture is
bit-identical to it. Each forward's rows are assigned to prompts from the forward's own token ids
and positions (``assign_rows``), not from the runner's internals.

Variants: ``own`` (the model as loaded) and ``llama_4_scaling_off`` (the worker's
``model.config.llama_4_scaling`` set to None before the run: exactly what a capture loop that
calls the layers without the argument computes; the negative control).

Run as a subprocess (vLLM spawns its engine; the caller's process has the shim active)::

    python -m speculators_compat_testbed.vllm_reference IN.pt OUT.pt

``IN.pt``: ``{"model_dir", "arch", "dtype", "max_model_len", "layer_ids", "batches": {name:
[[ids]]}, "variants": [...], "engine_kwargs": {...}}``; ``OUT.pt``: ``{"variants": {variant:
{name: [[tensor [len, hidden] per requested layer id] per sequence]}}, "margins": {name: [{layer:
[len]} per sequence]}, "routers", "init_s", "seconds", "vllm"}``.

Router margins (issue #14): forward hooks on every MoE layer's ``mlp.gate`` read the router
logits the engine's own forward computed; ``reference.router_margins`` turns them into the
per-token top-k margin (softmax, or DeepSeek-V3's sigmoid + e_score_correction_bias with
group-limited top-k, per the model config), so a bf16 outlier row can be checked against the
reference's near-ties.
"""

from __future__ import annotations

import os
import sys
import time

_STATE_ATTR = "_speculators_compat_reference"


def _inner(model):
    for cand in (getattr(model, "model", None), model):
        if cand is not None and hasattr(cand, "layers"):
            return cand
    getter = getattr(model, "get_language_model", None)
    if callable(getter):
        return getter().model
    raise RuntimeError(f"no decoder layers on {type(model).__qualname__}")


def _router_spec(layer, config):
    """(gate module, router_margins spec) of a vLLM decoder layer's MoE router, or None."""
    mlp = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)
    gate = getattr(mlp, "gate", None) if mlp is not None else None
    if gate is None or getattr(mlp, "experts", None) is None:
        return None
    top_k = getattr(config, "num_experts_per_tok", None) or getattr(mlp, "top_k", None)
    if top_k is None:
        return None
    bias = getattr(gate, "e_score_correction_bias", None)
    scoring = getattr(config, "scoring_func", None) or ("sigmoid" if bias is not None else "softmax")
    grouped = getattr(config, "topk_method", None) == "noaux_tc" or bias is not None
    n_group = int(getattr(config, "n_group", None) or 1) if grouped else 1
    topk_group = int(getattr(config, "topk_group", None) or n_group) if grouped else 1
    return gate, {"top_k": int(top_k), "scoring": scoring, "n_group": n_group, "topk_group": topk_group}


def _setup(model, layer_ids):
    from speculators_compat_testbed.reference import router_logits

    inner = _inner(model)
    state = {"rows": {i: [] for i in layer_ids}, "handles": [], "logits": {}, "routers": {}}
    config = getattr(inner, "config", None) or getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    for i, layer in enumerate(inner.layers):
        got = _router_spec(layer, config)
        if got is None:
            continue
        gate, spec = got
        bias = getattr(gate, "e_score_correction_bias", None)
        state["routers"][i] = dict(spec, bias=None if bias is None else bias.detach().float().cpu().clone())
        state["logits"][i] = []

        def gate_hook(module, args, output, i=i):
            state["logits"][i].append(router_logits(module, args, output))

        state["handles"].append(gate.register_forward_hook(gate_hook))

    def make(i):
        def hook(_module, _args, output):
            hidden, residual = output
            state["rows"][i].append((hidden if residual is None else hidden + residual).detach().to("cpu").clone())

        return hook

    for i in layer_ids:
        state["handles"].append(inner.layers[i].register_forward_hook(make(i)))
    from speculators_compat.extraction.selfcheck import embedding_of, positions_index

    state["ids"], state["pos"] = [], []
    embed = embedding_of(inner)
    at = positions_index(type(inner.layers[0]))

    def ids_hook(_module, args):
        if args and hasattr(args[0], "dim") and args[0].dim() == 1:
            state["ids"].append(args[0].detach().to("cpu").clone())

    def pos_hook(_module, args, kwargs):
        pos = kwargs.get("positions", args[at] if at is not None and at < len(args) else None)
        if pos is not None:
            pos = pos[0] if pos.dim() == 2 else pos  # M-RoPE [3, tokens]: a text token's are equal
            state["pos"].append(pos.detach().to("cpu").clone())

    if embed is not None:  # else the scheduled reference says it found no token ids
        state["handles"].append(embed.register_forward_pre_hook(ids_hook))
    state["handles"].append(inner.layers[0].register_forward_pre_hook(pos_hook, with_kwargs=True))
    setattr(model, _STATE_ATTR, state)
    return {"model": type(model).__qualname__, "layer": type(inner.layers[0]).__qualname__,
            "llama_4_scaling": getattr(inner.config, "llama_4_scaling", None),
            "routers": state["routers"]}


def _reset(model):
    state = getattr(model, _STATE_ATTR)
    for rows in list(state["rows"].values()) + list(state["logits"].values()) + [state["ids"], state["pos"]]:
        rows.clear()
    return True


def _collect_steps(model):
    """Per forward, its token ids and positions (lists), and its rows: [[layer, tensor of every
    forward's rows], ...] and [[MoE layer, router logits alike], ...] (one cat'ed tensor each:
    what ``apply_model`` returns intact across processes)."""
    import torch

    state = getattr(model, _STATE_ATTR)
    n = len(state["pos"])
    for name, got in [("token ids", state["ids"])] + [(f"layer {i}", r) for i, r in state["rows"].items()]:
        if len(got) != n:
            raise RuntimeError(f"expected one {name} record per forward ({n}); found {len(got)}")
    return [[t.tolist() for t in state["ids"]], [t.tolist() for t in state["pos"]],
            [[i, torch.cat(r)] for i, r in sorted(state["rows"].items())],
            [[i, torch.cat(z)] for i, z in sorted(state["logits"].items()) if len(z) == n]]


def assign_rows(prompts, ids, pos, progress: list[int]) -> list[tuple[int, int, int, int]]:
    """One forward's rows as [(prompt index, first position, first row, rows)]: each run of rows
    whose positions count up by one is matched against the prompts whose next uncomputed
    position it starts at, longest match first (ties: the earlier prompt, as FCFS schedules).
    Rows that continue no prompt end the forward (padding); the caller checks that every
    position of every prompt was assigned once. ``progress``: each prompt's positions assigned so
    far (advanced here)."""
    out, i, n = [], 0, len(pos)
    while i < n:
        p = int(pos[i])
        best, best_k = None, 0
        for r, prompt in enumerate(prompts):
            if progress[r] != p or p >= len(prompt):
                continue
            k = 0
            while i + k < n and p + k < len(prompt) and int(pos[i + k]) == p + k and int(ids[i + k]) == prompt[p + k]:
                k += 1
            if k > best_k:
                best, best_k = r, k
        if best is None:
            break  # the batch's padding; a real row left out shows as a prompt's missing position
        out.append((best, p, i, best_k))
        progress[best] += best_k
        i += best_k
    return out


def _collect(model):
    import torch

    state = getattr(model, _STATE_ATTR)
    return [[torch.cat(rows) if rows else None, len(rows)] for _i, rows in sorted(state["rows"].items())]


def _collect_logits(model):
    import torch

    state = getattr(model, _STATE_ATTR)
    return {i: torch.cat(rows) if rows else None for i, rows in state["logits"].items()}


def _set_scaling(model, value):
    inner = _inner(model)
    previous = getattr(inner.config, "llama_4_scaling", None)
    inner.config.llama_4_scaling = value
    return previous


def run(spec: dict) -> dict:
    import functools

    from vllm import LLM, SamplingParams

    import vllm

    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model_dir"],
        dtype=spec["dtype"],
        enforce_eager=True,
        max_model_len=spec["max_model_len"],
        enable_prefix_caching=False,
        seed=0,
        **spec.get("engine_kwargs", {}),
    )
    init_s = time.perf_counter() - t0
    layer_ids = sorted(set(spec["layer_ids"]))
    info = llm.apply_model(functools.partial(_setup, layer_ids=layer_ids))[0]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    out: dict = {"variants": {}, "init_s": init_s, "vllm": vllm.__version__, "worker": info}
    t1 = time.perf_counter()
    original = info["llama_4_scaling"]
    routers = info.get("routers") or {}
    out["routers"] = {i: {k: v for k, v in r.items() if k != "bias"} for i, r in routers.items()}
    out["margins"] = {}  # router top-k margins of the "own" forward: {case: [{layer: [len]}]}
    from speculators_compat_testbed.reference import router_margins

    if spec.get("schedule") == "generator":
        out["variants"]["own"] = _scheduled(llm, spec, params, layer_ids, routers, out, router_margins)
        out["seconds"] = time.perf_counter() - t1
        return out
    for variant in spec["variants"]:
        llm.apply_model(functools.partial(_set_scaling, value=None if variant == "llama_4_scaling_off" else original))
        per_batch = {}
        for name, seqs in spec["batches"].items():
            rows = []
            for seq in seqs:
                llm.apply_model(_reset)
                llm.generate([{"prompt_token_ids": list(seq)}], params, use_tqdm=False)
                got = llm.apply_model(_collect)[0]
                if variant == "own" and routers:
                    logits = llm.apply_model(_collect_logits)[0]
                    per = {}
                    for i, r in routers.items():
                        z = logits.get(i)
                        if z is None or z.shape[0] < len(seq):
                            # the gate ran elsewhere (a fused kernel): no margins for this layer, said so;
                            # the comparison then explains nothing from it (stricter, never looser)
                            out.setdefault("margin_problems", []).append(
                                f"{name}: router of layer {i} saw {None if z is None else z.shape[0]} tokens"
                                f" for a {len(seq)}-token prompt")
                            continue
                        # the prefill's rows (a sampled token's decode step is not run: max_tokens=1)
                        per[i] = router_margins(z[: len(seq)], r["top_k"], r["scoring"], r["bias"],
                                                r["n_group"], r["topk_group"])
                    out["margins"].setdefault(name, []).append(per)
                by_layer = {}
                for i, (t, calls) in zip(layer_ids, got):
                    if t is None or t.shape[0] != len(seq):
                        raise RuntimeError(
                            f"{variant}/{name}: layer {i} saw {None if t is None else t.shape[0]} rows in "
                            f"{calls} forward calls for a {len(seq)}-token prompt"
                        )
                    by_layer[i] = t
                # one tensor per REQUESTED id, in the caller's order (a repeated id: its layer again),
                # as the capture returns them; hooks ran once per distinct layer
                rows.append([by_layer[i] for i in spec["layer_ids"]])
            per_batch[name] = rows
        out["variants"][variant] = per_batch
    llm.apply_model(functools.partial(_set_scaling, value=original))
    out["seconds"] = time.perf_counter() - t1
    return out


def _scheduled(llm, spec, params, layer_ids, routers, out, router_margins) -> dict:
    """Each case's prompts in one ``generate`` (the generator's schedule); rows per prompt."""
    import torch

    per_batch, out["schedule"] = {}, {}
    for name, seqs in spec["batches"].items():
        llm.apply_model(_reset)
        llm.generate([{"prompt_token_ids": list(s)} for s in seqs], params, use_tqdm=False)
        ids_per, pos_per, layer_rows, logit_rows = llm.apply_model(_collect_steps)[0]
        starts = [sum(len(p) for p in pos_per[:k]) for k in range(len(pos_per))]
        progress = [0] * len(seqs)
        parts: list[list] = [[] for _ in seqs]  # per prompt: [(position, step, first row in the cat, rows)]
        for k, (ids, pos) in enumerate(zip(ids_per, pos_per)):
            for r, p, row, n in assign_rows(seqs, ids, pos, progress):
                parts[r].append((p, k, starts[k] + row, n))
        out["schedule"][name] = [[(p, k, n) for p, k, _row, n in sorted(pp)] for pp in parts]
        rows, margins = [], []
        layers = dict((int(i), t) for i, t in layer_rows)
        logits = dict((int(i), z) for i, z in logit_rows)
        total = sum(len(p) for p in pos_per)
        bad = [(i, t.shape[0]) for i, t in list(layers.items()) + list(logits.items()) if t.shape[0] != total]
        if bad or [len(x) for x in ids_per] != [len(p) for p in pos_per]:
            raise RuntimeError(f"{name}: expected every forward's layer rows, router logits and token ids to match "
                               f"its positions ({total} rows); found {bad or 'token ids of other lengths'}")
        for r, seq in enumerate(seqs):
            pp = sorted(parts[r])
            covered = [p for p, _k, _row, _n in pp]
            expect = [sum(n for _p, _k, _row, n in pp[:j]) for j in range(len(pp))]
            if covered != expect or sum(n for *_x, n in pp) != len(seq):
                raise RuntimeError(f"{name}: prompt {r} ({len(seq)} tokens) was computed as spans {pp}: "
                                   "expected each position once")
            by_layer = {i: torch.cat([layers[i][row:row + n] for _p, _k, row, n in pp]) for i in layer_ids}
            rows.append([by_layer[i] for i in spec["layer_ids"]])
            per = {}
            for i, rt in routers.items():
                if int(i) in logits:
                    z = torch.cat([logits[int(i)][row:row + n] for _p, _k, row, n in pp])
                    per[i] = router_margins(z, rt["top_k"], rt["scoring"], rt["bias"], rt["n_group"], rt["topk_group"])
                else:
                    out.setdefault("margin_problems", []).append(f"{name}: router of layer {i}: not one record per forward")
            margins.append(per)
        per_batch[name] = rows
        if routers:
            out["margins"][name] = margins
    return per_batch


def main(argv=None) -> int:
    import torch

    argv = sys.argv[1:] if argv is None else argv
    src, dst = argv
    spec = torch.load(src, weights_only=False)
    # Run from the importable module, not __main__: the worker functions sent through
    # apply_model must pickle by reference (vLLM 0.32's shm broadcast uses plain pickle).
    from speculators_compat_testbed import vllm_reference

    result = vllm_reference.run(spec)
    torch.save(result, dst)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
