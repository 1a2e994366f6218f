"""Every call checks a sample of its rows against what the engine itself computed there.

Per sampled step the worker keeps, on the device, for the first and last row of a few sequences:
the token ids the engine embedded and the positions it gave the layers (the driver compares them
with the sequence and row it placed the row at), each captured layer's row as computed (the rows
in the exchange must be bit-identical after ``finish``), and the model's final-norm output (the
captured last layer, normed by the model's own final norm, must give it). Any mismatch fails the
call (``SelfCheckFailed``); ``SPECULATORS_COMPAT_SELF_CHECK_ROWS=0`` turns it off. ``due`` keeps
its cost within ``SPECULATORS_COMPAT_SELF_CHECK_BUDGET`` of the calls' time (the first call always).
"""

from __future__ import annotations

import inspect
from typing import Any

from .errors import ExtractionError, context

__all__ = ["SelfCheckFailed", "RowCheck", "due", "judge", "final_norm_of", "positions_index", "tolerance"]

FINAL_NORMS = ("norm", "final_layernorm", "final_norm", "ln_f")
EMBEDDINGS = ("embed_tokens", "embedding", "wte")


class SelfCheckFailed(ExtractionError):
    """A sampled row disagrees with the engine's own computation: the call's data are wrong."""


# The sampling inside the forward is not timed (it runs in the engine's steps); on the H200 it
# measured below the timed finish work (1.42 vs 1.89 ms per call, 8B-like shape): doubling covers it.
UNTIMED_FACTOR = 2.0


def due(tally: dict | None, budget: float) -> bool:
    """Whether this call is checked: the first call always, then while the checked calls' timed
    work (``check_s``, doubled) stays within ``budget`` of every call's time (``call_s``)."""
    if budget >= 1 or not tally or not tally.get("checked_calls"):
        return True
    return UNTIMED_FACTOR * tally.get("check_s", 0.0) <= budget * tally.get("call_s", 0.0)


def tolerance(dtype) -> float:
    """Relative L2 limit of norm(captured last-layer row) vs the engine's final-norm output: the
    two differ by one rounding of the residual sum (measured ~3e-3 in bf16); a misplaced or
    zeroed row differs by ~1."""
    import torch

    return max(8 * torch.finfo(dtype).eps, 1e-4)


def final_norm_of(base, num_layers: int, end: int):
    """(module, why not): the model's final norm where this stage runs it, else a reason."""
    if end != num_layers:
        return None, "the final norm is on another pipeline stage"
    for name in FINAL_NORMS:
        module = getattr(base, name, None)
        if module is not None and callable(module) and type(module).__name__ != "PPMissingLayer":
            return module, None
    return None, f"{type(base).__name__} has none of {', '.join(FINAL_NORMS)}"


def embedding_of(base):
    for name in EMBEDDINGS:
        module = getattr(base, name, None)
        if module is not None and callable(module) and type(module).__name__ != "PPMissingLayer":
            return module
    return None


def positions_index(layer_cls) -> int | None:
    """Index of ``positions`` among a layer forward's positional arguments (after self)."""
    try:
        names = list(inspect.signature(layer_cls.forward).parameters)[1:]
    except (TypeError, ValueError):
        return None
    return names.index("positions") if "positions" in names else None


KINDS = {"tokens": "token ids", "positions": "positions", "copies": "layer rows", "final": "final norm"}


class _Sample:
    __slots__ = ("meta", "src", "index", "ids", "pos", "layers", "final")

    def __init__(self, meta, src):
        self.meta, self.src = meta, src  # [(req_id, destination row)], [source row]
        self.index = None
        self.ids = self.pos = self.final = None
        self.layers: dict = {}

    def rows(self, tensor):
        """The sampled rows of ``tensor`` (on its device, no wait); None where it is not one row
        per token of the step (another layout: that kind is then not covered, never an error)."""
        import torch

        if getattr(tensor, "dim", lambda: 0)() < 1 or tensor.shape[0] <= max(self.src):
            return None
        if self.index is None or self.index.device != tensor.device:
            index = torch.tensor(self.src, dtype=torch.long)
            if tensor.device.type == "cuda":  # page-locked and asynchronous: no wait inside the forward
                index = index.pin_memory().to(tensor.device, non_blocking=True)
            self.index = index.to(tensor.device)
        return tensor.index_select(0, self.index)


class RowCheck:
    """The worker's samples of one call (``rows`` per sampled step; 0: off)."""

    def __init__(self, rows: int):
        self.rows = max(0, int(rows))
        self.samples: list[_Sample] = []
        self.steps = 0

    def pick(self, spans) -> _Sample | None:
        """This step's sample: the first and last row of up to rows/2 sequences, on steps 0-3 and
        every power of two after (a long call costs a few samples, early and late steps alike)."""
        step, self.steps = self.steps, self.steps + 1
        if not self.rows or not spans or (step > 3 and step & (step - 1)):
            return None
        k = max(1, self.rows // 2)
        chosen = spans if len(spans) <= k else [spans[(step + i * len(spans) // k) % len(spans)] for i in range(k)]
        meta, src = [], []
        for s, rid, d, n in chosen:
            for off in sorted({0, n - 1}):
                meta.append((rid, d + off))
                src.append(s + off)
        sample = _Sample(meta, src)
        self.samples.append(sample)
        return sample

    def report(self, exchange_rows, slots: dict, final_norm, final_slot, why_not: dict) -> dict:
        """What the driver judges: the token seen per sampled (req_id, row), the rows that failed,
        how many rows each kind saw, and why a kind saw none (``why_not``, by kind). Every sample
        at once, on the samples' device: one gather of the exchange's rows (``exchange_rows``:
        [(req_id, slot, row)] -> rows) sent there, the comparisons and one final-norm call there,
        one transfer back; ``cost_s``: the time each part took ("norm": the final norm's share of "device")."""
        import time

        import torch

        clock, cost = time.perf_counter, {"gather": 0.0, "device": 0.0, "norm": 0.0, "transfer": 0.0}
        out: dict[str, Any] = {"cost_s": cost, "rows": sum(len(s.meta) for s in self.samples), "off": not self.rows,
                               "tokens": [], "positions_bad": [], "copies_bad": [], "final_max_rel_error": 0.0,
                               "final_bad": [], "seen": dict.fromkeys(KINDS, 0), "why_not": dict(why_not)}
        seen = out["seen"]
        layer_of = {slot: lid for lid, slot in slots.items()}
        small = [(s, kind, t) for s in self.samples for kind, t in (("tokens", s.ids), ("positions", s.pos))
                 if t is not None]
        pairs = [(s, slot) for s in self.samples for slot in s.layers]
        finals = [s for s in self.samples if s.final is not None] if final_norm is not None else []
        mark = clock()
        # the exchange's rows of every (sample, slot) compared, then the final slot's rows of every
        # normed sample again (contiguous: no index on the device): one gather
        keys = pairs + [(s, final_slot) for s in finals]
        host_rows = torch.empty(0, dtype=torch.uint8)
        if keys:
            host_rows = exchange_rows([(rid, slot, d) for s, slot in keys for rid, d in s.meta])
        cost["gather"] = clock() - mark
        mark = clock()
        tensors = [t for _, _, t in small] + [s.layers[slot] for s, slot in pairs] + [s.final for s in finals]
        device = tensors[0].device if tensors else torch.device("cpu")
        # the parts of the one transfer back; float64 keeps token ids and positions exact (float32
        # only below 2**24, the fallback where a device has no float64)
        wide = torch.float64 if device.type in ("cpu", "cuda") else torch.float32
        packed = []
        if small:
            packed.append(torch.cat([t.reshape(-1) for _, _, t in small]).to(wide))
        rows = host_rows.to(device) if keys else host_rows
        n = sum(len(s.meta) for s, _ in pairs)
        if pairs:  # the layers' rows as computed vs the exchange's, bit for bit
            # the copy converts to the exchange's dtype (a layer may keep an fp32 residual in fp16)
            computed = torch.cat([s.layers[slot].to(rows.dtype) for s, slot in pairs])
            same = (computed.view(torch.uint8).view(n, -1) == rows[:n].view(torch.uint8).view(n, -1)).all(dim=1)
            packed.append(same.to(wide))
        normed_ok = False
        if finals:  # the captured last layer, normed by the model: one call
            started = clock()
            ref = torch.cat([s.final for s in finals]).float()
            try:
                with torch.no_grad():
                    normed = final_norm(rows[n:].to(ref.device))
                normed = normed[0] if isinstance(normed, tuple) else normed
            except Exception as exc:  # noqa: BLE001 - the norm outside its forward: not covered, never a failure
                out["why_not"]["final"] = f"the final norm cannot be re-run: {type(exc).__name__}: {exc}"[:200]
            else:
                rel = (normed.float() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-12)
                packed.append(rel.to(device=device, dtype=wide))
                packed.append(torch.isfinite(ref).all(dim=-1).to(device=device, dtype=wide))
                normed_ok = True
            cost["norm"] = clock() - started  # part of "device"
        cost["device"] = clock() - mark
        mark = clock()
        values = torch.cat(packed).cpu().tolist() if packed else []
        cost["transfer"] = clock() - mark
        k = 0
        for s, kind, t in small:
            part, k = values[k:k + t.numel()], k + t.numel()
            seen[kind] += len(s.meta)
            if kind == "tokens":
                out["tokens"] += [(rid, d, int(v)) for (rid, d), v in zip(s.meta, part)]
            else:
                out["positions_bad"] += [(rid, d, int(v)) for (rid, d), v in zip(s.meta, part) if v != d]
        for s, slot in pairs:
            part, k = values[k:k + len(s.meta)], k + len(s.meta)
            seen["copies"] += len(s.meta)
            out["copies_bad"] += [(rid, d, layer_of[slot]) for (rid, d), ok in zip(s.meta, part) if ok != 1.0]
        if normed_ok:
            meta = [m for s in finals for m in s.meta]
            rel, ref_finite = values[k:k + len(meta)], values[k + len(meta):]
            limit = tolerance(finals[0].final.dtype)
            seen["final"] += len(meta)
            out["final_max_rel_error"] = max([0.0, *(e for e in rel if e == e)])
            out["final_limit"] = limit
            out["final_bad"] = [(rid, d, e, f == 1.0) for (rid, d), e, f in zip(meta, rel, ref_finite) if not e <= limit]
        return out


def judge(reports, sequences: dict, layer_ids) -> dict:
    """The call's self-check from the capturing ranks' reports (one per pipeline stage); raises
    ``SelfCheckFailed``. A kind no rank saw is listed in ``not_covered`` with the ranks' reasons."""
    reports = [r for r in reports if r]
    summary: dict[str, Any] = {"rows": 0, "tokens_checked": 0, "positions_checked": 0, "copies_checked": 0,
                               "final_rows": 0, "final_max_rel_error": 0.0, "not_covered": []}
    problems = []
    seen = dict.fromkeys(KINDS, 0)
    for rep in reports:
        summary["rows"] += rep["rows"]
        for kind in KINDS:
            seen[kind] += rep["seen"][kind]
        summary["final_max_rel_error"] = max(summary["final_max_rel_error"], rep["final_max_rel_error"])
        wrong = [(rid, d, t, sequences[rid][d]) for rid, d, t in rep["tokens"] if sequences[rid][d] != t]
        if wrong:
            rid, d, t, want = wrong[0]
            problems.append(f"{len(wrong)} row(s) hold another sequence's token: row {d} of {rid} was computed for "
                            f"token {t}; expected {want}")
        if rep["positions_bad"]:
            rid, d, p = rep["positions_bad"][0]
            problems.append(f"{len(rep['positions_bad'])} row(s) at another position: row {d} of {rid} was computed "
                            f"at position {p}")
        if rep["copies_bad"]:
            rid, d, lid = rep["copies_bad"][0]
            problems.append(f"{len(rep['copies_bad'])} row(s) differ from what the layer computed: row {d} of {rid}, "
                            f"layer {lid}")
        engine_made = [b for b in rep["final_bad"] if len(b) > 3 and not b[3]]
        if engine_made:  # the engine's own output is not finite: the model computed it, not the capture
            rid, d = engine_made[0][:2]
            problems.append(f"{len(engine_made)} row(s) where the model's own final-norm output is non-finite "
                            f"(NaN/inf computed by the engine, not misplaced by the capture): row {d} of {rid}; "
                            "training on these rows would fail")
        wrong = [b for b in rep["final_bad"] if not (len(b) > 3 and not b[3])]
        if wrong:
            rid, d, e = wrong[0][:3]
            what = "a non-finite row" if e != e else f"relative error {e:.3g} (limit {rep['final_limit']:.3g})"
            problems.append(f"{len(wrong)} last-layer row(s) do not give the model's own final-norm "
                            f"output: row {d} of {rid}, {what}")
    summary.update(tokens_checked=seen["tokens"], positions_checked=seen["positions"],
                   copies_checked=seen["copies"], final_rows=seen["final"])
    if any(r.get("off") for r in reports):
        summary["not_covered"] = ["off (SPECULATORS_COMPAT_SELF_CHECK_ROWS=0)"]
    elif summary["rows"]:
        for kind, label in KINDS.items():
            if not seen[kind]:
                why = sorted({r["why_not"][kind] for r in reports if r["why_not"].get(kind)})
                summary["not_covered"].append(f"{label} ({'; '.join(why) or 'no sampled row reached it'})")
    if problems:
        raise SelfCheckFailed(
            f"speculators-compat self-check failed (layers {list(layer_ids)}): " + "; ".join(problems)
            + ". These rows are wrong; nothing of this call is returned "
            "(SPECULATORS_COMPAT_SELF_CHECK_ROWS=0 skips the check)\n[" + context() + "]"
        )
    return summary
