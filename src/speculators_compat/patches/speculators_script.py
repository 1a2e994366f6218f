"""speculators' own data-generation script (``scripts/data_generation_offline.py``) on a CPU vLLM.

These are bugs of speculators, not vLLM changes: they stop speculators' script wherever no
accelerator is present (vLLM's CPU build), before or after the generator has done its work.
Versions: compat_matrix.yaml.

- ``script-tp-default`` (speculators 0.3.0 and 0.4.x): the script's ``--tensor-parallel-size``
  defaults to ``torch.accelerator.device_count()`` (its help says "default: 1"), which is 0 with
  no accelerator; ``VllmHiddenStatesGenerator(tensor_parallel_size=0)`` then fails in vLLM's
  ``ParallelConfig`` validation (and would build zero KV-cache configs). The patch gives the
  class a ``__new__``: for exactly that call — ``tensor_parallel_size=0`` while
  ``torch.accelerator.device_count()`` is 0 — it returns an instance of a subclass of the same
  name whose constructor passes 1 instead (and logs it); every other call gets a plain instance
  and reaches speculators' constructor unchanged (0 with devices still fails in vLLM, as before).
  (``__new__`` because ``__init__`` is owned by ``memory-query-torch-cuda`` and the class itself
  must stay the object the other patches are applied to.)
- ``device-name-no-accelerator`` (speculators 0.4.x): ``save_config`` → ``DataGenerationConfig``
  → ``_get_gpu_info`` → ``speculators.utils.util.get_device_name(0)`` asks
  ``torch.accelerator.current_accelerator()``, which names the torch *build's* accelerator even
  when no device is present; with a CUDA build of torch and no GPU, ``torch.cuda.get_device_name``
  raises "Found no NVIDIA driver" after every data file was written, and ``data_config.json`` is
  missing. The patch wraps the name ``get_device_name`` in ``config_generator`` (the namespace
  ``_get_gpu_info`` reads at call time, also as the dataclass's default factory): with no device
  (``torch.accelerator.device_count() == 0``) it returns speculators' own "NO ACCELERATOR", which
  ``_get_gpu_info`` turns into "CPU ONLY"; otherwise it calls speculators' function. (0.3.0 asks
  ``torch.cuda.is_available()`` first and is not affected.)
- ``generator-del-partial`` (speculators 0.3.0 and 0.4.x): ``VllmHiddenStatesGenerator.__del__``
  calls ``self.executor.shutdown()`` and logs a warning if that raises. A generator that lives
  until interpreter exit (``gen = VllmHiddenStatesGenerator(...)`` at the top level of a script,
  as in README's snippet) is finalised after speculators' module globals were cleared: shutdown
  fails, the ``except`` branch's ``log.warning`` finds ``log`` set to None, and Python prints
  ``Exception ignored in: <function VllmHiddenStatesGenerator.__del__>`` …
  ``AttributeError: 'NoneType' object has no attribute 'warning'`` at every exit (measured:
  0.4.0.1 on vLLM 0.32; the script itself drops its generator earlier and is not affected). The
  patch runs speculators' ``__del__`` and drops only an ``AttributeError`` raised from it.
"""

from __future__ import annotations

import inspect
import logging
import sys

from ..registry import MISSING, Patch, wrapper_patch
from ._signatures import GENERATOR, import_attr, require_params

CONFIG_GENERATOR = "speculators.data_generation.config_generator"
_log = logging.getLogger("speculators_compat")


def _no_accelerator() -> bool:
    import torch

    return torch.accelerator.device_count() == 0


def _tp_fixed(args: tuple, kwargs: dict, signature: inspect.Signature) -> tuple[tuple, dict] | None:
    """The constructor arguments with tensor_parallel_size=1, or None when nothing is to fix."""
    try:
        bound = signature.bind(None, *args, **kwargs)
    except TypeError:
        return None  # speculators reports its own error
    if bound.arguments.get("tensor_parallel_size") != 0 or not _no_accelerator():
        return None
    bound.arguments["tensor_parallel_size"] = 1
    return tuple(bound.args[1:]), dict(bound.kwargs)


_fixing_subclasses: dict[type, type] = {}


def _fixing_subclass(cls: type, signature: inspect.Signature) -> type:
    sub = _fixing_subclasses.get(cls)
    if sub is None:

        def __init__(self, *args, **kwargs):
            fixed = _tp_fixed(args, kwargs, signature)
            if fixed is not None:
                _log.warning(
                    "speculators_compat: tensor_parallel_size=0 (speculators' script default "
                    "torch.accelerator.device_count() with no accelerator) -> 1"
                )
                args, kwargs = fixed
            super(sub, self).__init__(*args, **kwargs)

        sub = type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
        _fixing_subclasses[cls] = sub
    return sub


def _build_tp_default(current):
    base = import_attr(GENERATOR, "VllmHiddenStatesGenerator")
    signature = inspect.signature(base.__init__)

    def __new__(cls, *args, **kwargs):
        if cls not in _fixing_subclasses.values() and _tp_fixed(args, kwargs, signature) is not None:
            cls = _fixing_subclass(cls, signature)
        return object.__new__(cls)

    return staticmethod(__new__)


def _probe_tp_default(current):
    cls = import_attr(GENERATOR, "VllmHiddenStatesGenerator")
    if not isinstance(cls, type):
        return f"expected {GENERATOR}:VllmHiddenStatesGenerator to be a class; found {cls!r}"
    own = vars(cls).get("__new__")
    if own is not None:
        return f"expected VllmHiddenStatesGenerator without a __new__ of its own; found {own!r}"
    problem = require_params(cls.__init__, ("self", "model_path", "tensor_parallel_size"),
                             "VllmHiddenStatesGenerator.__init__")
    if problem:
        return problem
    try:
        inspect.signature(cls.__init__).bind(None, "model", tensor_parallel_size=1)
    except TypeError as exc:
        return f"expected VllmHiddenStatesGenerator(model_path, tensor_parallel_size=1) to bind; {exc}"
    torch = sys.modules.get("torch") or __import__("torch")
    if not callable(getattr(getattr(torch, "accelerator", None), "device_count", None)):
        return "expected torch.accelerator.device_count(); not found"
    return None


def _device_name(wrapped, instance, args, kwargs):
    if _no_accelerator():
        return "NO ACCELERATOR"  # speculators' own answer when torch names no accelerator
    return wrapped(*args, **kwargs)


def _probe_device_name(current):
    if current is MISSING or not callable(current):
        return f"expected {CONFIG_GENERATOR}.get_device_name (speculators.utils.util); found {current!r}"
    try:
        inspect.signature(current).bind(0)
    except (TypeError, ValueError) as exc:
        return f"expected get_device_name(idx) to bind get_device_name(0); {exc}"
    try:
        gpu_info = import_attr(CONFIG_GENERATOR, "_get_gpu_info")
    except (ImportError, AttributeError):
        return f"expected {CONFIG_GENERATOR}._get_gpu_info (its caller); not found"
    source = inspect.getsource(gpu_info)
    if "get_device_name(" not in source or "NO ACCELERATOR" not in source:
        return "expected _get_gpu_info to call get_device_name and treat 'NO ACCELERATOR'; it does not"
    return None


def _del_quiet(wrapped, instance, args, kwargs):
    try:
        return wrapped(*args, **kwargs)
    except AttributeError:
        return None  # a half-built or half-torn-down generator at exit: nothing left to shut down


def _probe_del(current):
    if current is MISSING or not callable(current):
        return f"expected VllmHiddenStatesGenerator.__del__; found {current!r}"
    try:
        source = inspect.getsource(getattr(current, "__wrapped__", current))
    except (OSError, TypeError):
        return "expected VllmHiddenStatesGenerator.__del__ with readable source; unreadable"
    if "executor" not in source or "shutdown" not in source:
        return "expected VllmHiddenStatesGenerator.__del__ to shut the executor down; it does not"
    return None


PATCHES = [
    wrapper_patch(
        "generator-del-partial",
        "speculators-script",
        GENERATOR,
        "VllmHiddenStatesGenerator.__del__",
        _del_quiet,
        _probe_del,
    ),
    Patch(
        id="script-tp-default",
        family="speculators-script",
        hook_module=GENERATOR,
        attribute="VllmHiddenStatesGenerator.__new__",
        build=_build_tp_default,
        probe=_probe_tp_default,
    ),
    wrapper_patch(
        "device-name-no-accelerator",
        "speculators-script",
        CONFIG_GENERATOR,
        "get_device_name",
        _device_name,
        _probe_device_name,
    ),
]
