"""Input to ``generate``: one clear line for anything the engine would fail on later.

Checked before anything is scheduled, so a bad call leaves the generator usable. Token ids
come as a list (or tuple) of sequences, each a list/tuple of Python or NumPy integers or a
1-D integer tensor/array, or as one 2-D integer tensor/array whose rows are the sequences.
"""

from __future__ import annotations

from numbers import Integral


def _kind(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}".replace("builtins.", "")


def _is_array(obj) -> bool:
    return hasattr(obj, "ndim") and hasattr(obj, "tolist") and hasattr(obj, "dtype")


def _integer_dtype(arr) -> bool:
    dtype = arr.dtype
    name = str(dtype).replace("torch.", "")
    if name == "bool":
        return False
    is_floating = getattr(dtype, "is_floating_point", None)
    if is_floating is not None:  # torch
        return not is_floating and not getattr(dtype, "is_complex", False)
    return getattr(dtype, "kind", "") in ("i", "u")  # numpy


def sequences(token_ids) -> list[list[int]]:
    """The sequences as lists (tensor/array rows converted), or a one-line ValueError."""
    if _is_array(token_ids):
        if token_ids.ndim == 1:
            raise ValueError(
                f"token_ids is one 1-D {_kind(token_ids)} of {len(token_ids)} ids: pass a list of sequences "
                "(e.g. [ids]) or a 2-D array whose rows are sequences"
            )
        if token_ids.ndim != 2:
            raise ValueError(f"token_ids is a {token_ids.ndim}-D {_kind(token_ids)}: expected 2-D (sequences × tokens)")
        if token_ids.shape[0] == 0:
            raise ValueError("token_ids cannot be empty")
        if not _integer_dtype(token_ids):
            raise ValueError(f"token_ids has dtype {token_ids.dtype}: token ids must be integers")
        return token_ids.tolist()
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__len__"):
        raise ValueError(f"token_ids is a {_kind(token_ids)}: expected a list of token-id sequences")
    if len(token_ids) == 0:
        raise ValueError("token_ids cannot be empty")
    out = []
    for i, ids in enumerate(token_ids):
        if _is_array(ids):
            if ids.ndim != 1:
                raise ValueError(f"token_ids[{i}] is a {ids.ndim}-D {_kind(ids)}: each sequence must be 1-D")
            if not _integer_dtype(ids):
                raise ValueError(f"token_ids[{i}] has dtype {ids.dtype}: token ids must be integers")
            out.append(ids.tolist())
        elif isinstance(ids, (list, tuple)):
            out.append(list(ids))
        else:
            raise ValueError(f"token_ids[{i}] is a {_kind(ids)}: each sequence must be a list of token ids")
    return out


def token_tensors(seqs, torch):
    """Each sequence as an int64 tensor over an ``array('q')`` (zero-copy; ~5x faster than
    ``torch.as_tensor`` on a list), or None where a sequence holds something that is not a
    64-bit integer or holds a bool (``check_token_ids`` then names it)."""
    from array import array

    try:
        out = []
        for ids in seqs:
            if not len(ids):
                out.append(torch.empty(0, dtype=torch.long))
                continue
            if any(t.__class__ is bool for t in ids):
                return None
            out.append(torch.frombuffer(array("q", ids), dtype=torch.long))
        return out
    except (TypeError, OverflowError, ValueError):
        return None


def check_token_ids(seqs, vocab_size: int, tensors=None) -> None:
    """One-line ValueError for an empty sequence, a non-integer (bools included) or
    out-of-vocabulary id. With ``tensors`` (``token_tensors``) the all-valid case is one
    vectorised min/max."""
    if tensors is not None and all(len(t) for t in tensors):
        import torch

        low, high = (int(v) for v in torch.cat(tensors).aminmax())
        if low >= 0 and high < vocab_size:
            return
    for i, ids in enumerate(seqs):
        if len(ids) == 0:
            raise ValueError(f"token_ids[{i}] is empty: every sequence needs at least one token")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, Integral):
                raise ValueError(f"token_ids[{i}] holds {t!r} ({type(t).__name__}): token ids must be integers")
        low, high = min(ids), max(ids)
        if low < 0 or high >= vocab_size:
            pos = ids.index(low if low < 0 else high)
            raise ValueError(
                f"token_ids[{i}][{pos}] = {ids[pos]} is outside the model's vocabulary [0, {vocab_size})"
            )


def check_layer_ids(layer_ids) -> tuple[list[int], list[int]]:
    """(the distinct layers captured, ascending; one entry per requested id, ascending), or a
    one-line ValueError. speculators' own default ``[2, n // 2, n - 3, n - 1]`` repeats a layer
    on small models: a repeated id gets its layer's tensor again, so ``hidden_states`` always
    holds as many tensors as ids were asked for (speculators returns one per distinct layer)."""
    ids = list(layer_ids)
    if not ids:
        raise ValueError("layer_ids is empty: name at least one decoder layer to capture")
    for lid in ids:
        if isinstance(lid, bool) or not isinstance(lid, Integral):
            raise ValueError(f"layer_ids holds {lid!r} ({type(lid).__name__}): layer ids must be integers")
    requested = sorted(int(x) for x in ids)
    return sorted(set(requested)), requested
