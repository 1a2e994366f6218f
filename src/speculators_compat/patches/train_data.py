"""speculators' trainer reads the FP8 data files of ``SPECULATORS_COMPAT_STORE_DTYPE=fp8``.

``train-data-fp8`` wraps ``Eagle3SampleFileDataset.__init__`` (speculators 0.3.0 and 0.4.x,
``speculators/train/data.py``): the ``standardize_fn`` it is given (speculators' default
``standardize_data_v1`` or the caller's) runs on the sample decoded by ``storage.decode``, so
an FP8 file reaches speculators as bf16-shaped ``hidden_states`` (float32 rows); a bf16 file
passes through unchanged. The probe checks that ``__getitem__`` loads with ``torch.load`` and
hands the result to ``self.standardize_fn``. Without the shim an FP8 file has no
``hidden_states`` key: speculators' loader fails (KeyError), it never trains on unscaled values.
"""

from __future__ import annotations

import functools
import inspect

from ..registry import MISSING, Call, wrapper_patch
from ._signatures import import_attr, parameters

TRAIN_DATA = "speculators.train.data"


class Decoding:
    """``standardize_fn`` that first decodes an FP8 sample; a module-level class, so a DataLoader
    whose workers start with spawn can pickle it (a closure could not)."""

    def __init__(self, standardize_fn):
        self.standardize_fn = standardize_fn
        functools.update_wrapper(self, standardize_fn)

    def __call__(self, data):
        from .. import storage

        return self.standardize_fn(storage.decode(data))


def decoding(standardize_fn):
    """``standardize_fn`` wrapped in ``Decoding`` (idempotent: never wraps twice)."""
    return standardize_fn if isinstance(standardize_fn, Decoding) else Decoding(standardize_fn)


def _dataset_init(wrapped, instance, args, kwargs):
    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    bound.apply_defaults()
    bound.arguments["standardize_fn"] = decoding(bound.arguments["standardize_fn"])
    return wrapped(*bound.args, **bound.kwargs)


def _probe_dataset(current):
    if current is MISSING:
        return f"expected {TRAIN_DATA}.Eagle3SampleFileDataset.__init__; not found"
    params = parameters(current)
    if params is None or "standardize_fn" not in params or params["standardize_fn"].default is inspect.Parameter.empty:
        return f"expected Eagle3SampleFileDataset.__init__(..., standardize_fn=<default>); found {params and list(params)}"
    getitem = getattr(import_attr(TRAIN_DATA, "Eagle3SampleFileDataset"), "__getitem__", None)
    code = getattr(getitem, "__code__", None)
    if code is None or not {"load", "standardize_fn"} <= set(code.co_names):
        return ("expected Eagle3SampleFileDataset.__getitem__ to torch.load a file and pass it to "
                f"self.standardize_fn; found names {code and sorted(code.co_names)}")
    return None


PATCHES = [
    wrapper_patch(
        "train-data-fp8",
        "train-data",
        TRAIN_DATA,
        "Eagle3SampleFileDataset.__init__",
        _dataset_init,
        _probe_dataset,
        calls=(Call(TRAIN_DATA, "Eagle3SampleFileDataset", kwargs=("max_len", "file_list", "standardize_fn")),),
    ),
]
