"""``import speculators`` on new transformers and vLLM.

``speculators-import-torch-annotation``: transformers 5 annotates ``PretrainedConfig.dtype`` with
a ``TYPE_CHECKING``-only ``torch``, so speculators' import fails (``NameError: torch``); a hook on
``transformers.configuration_utils`` binds ``torch`` there first. ``attn-mask-utils-stand-in``,
``hashing-module-alias`` and ``kv-cache-planning-names`` give speculators' module-level imports
what transformers 5.2x and vLLM 0.11.0 / 0.33 moved (module aliases inserted by the registry).
Versions: compat_matrix.yaml. Details: docs/MODULES.md.
"""

from __future__ import annotations

import sys

from ..registry import MISSING, NotNeeded, Patch

_TARGET = "transformers.configuration_utils"


def _build(current):
    return sys.modules["torch"] if "torch" in sys.modules else __import__("torch")


def _probe(current):
    if current is not MISSING:
        return f"expected {_TARGET} without a module-level name 'torch'; found {current!r}"
    module = sys.modules.get(_TARGET)
    if module is None:
        return f"expected {_TARGET} to be imported; it is not"
    config_cls = getattr(module, "PretrainedConfig", None)
    annotations = {}
    for klass in getattr(config_cls, "__mro__", ()):
        annotations.update(getattr(klass, "__annotations__", {}) or {})
    if not any("torch" in str(a) for a in annotations.values()):
        return f"expected PretrainedConfig annotations to reference torch; found none ({_TARGET})"
    return None


def _build_hashing_module(current):
    """A ``vllm.utils.hashing`` module exposing 0.11.0's ``vllm.utils.get_hash_fn_by_name``."""
    import types

    utils = sys.modules["vllm.utils"]
    module = types.ModuleType("vllm.utils.hashing", "speculators_compat alias of vllm.utils hashing helpers")
    module.get_hash_fn_by_name = utils.get_hash_fn_by_name
    return module  # the registry enters it in sys.modules (module_alias) and removes it on revert


def _probe_hashing(current):
    import importlib.util

    if current is not MISSING or "vllm.utils.hashing" in sys.modules or importlib.util.find_spec("vllm.utils.hashing"):
        return NotNeeded("this vLLM has vllm.utils.hashing")
    if not callable(getattr(sys.modules.get("vllm.utils"), "get_hash_fn_by_name", None)):
        return "expected vllm.utils.get_hash_fn_by_name (vLLM 0.11.0); not found"
    return None


_MASK_MODULE = "transformers.modeling_attn_mask_utils"


def _removed_mask_helper(*args, **kwargs):
    import transformers

    raise NotImplementedError(
        f"transformers {transformers.__version__} removed {_MASK_MODULE}._prepare_4d_causal_attention_mask; "
        "speculators' Eagle model (training) calls it and needs transformers<5.20. speculators-compat only "
        "makes the import succeed so that the hidden-state generator, which never calls it, can run."
    )


def _build_mask_module(current):
    import types

    module = types.ModuleType(_MASK_MODULE, "speculators_compat stand-in: the helper raises a clear error when called")
    module._prepare_4d_causal_attention_mask = _removed_mask_helper
    return module  # the registry enters it in sys.modules (module_alias) and removes it on revert


def _probe_mask_module(current):
    import importlib.util

    if current is not MISSING or _MASK_MODULE in sys.modules or importlib.util.find_spec(_MASK_MODULE) is not None:
        return NotNeeded(f"this transformers still has {_MASK_MODULE}")
    return None


KV_CACHE_UTILS = "vllm.v1.core.kv_cache_utils"
# where a vLLM release may define the names speculators imports from kv_cache_utils (newest first)
KV_CACHE_HOMES = ("vllm.v1.core.kv_cache_planning",)
MOVED_KV_CACHE_NAMES = ("_get_kv_cache_groups_uniform_spec", "get_kv_cache_config_from_groups", "unify_hybrid_kv_cache_specs")


def _home_of(name: str):
    import importlib

    for home in KV_CACHE_HOMES:
        module = sys.modules.get(home) or importlib.import_module(home)
        if name in vars(module):
            return module
    return None


def _build_moved_names(current):
    previous = current if current is not MISSING else None

    def __getattr__(name):
        if name in MOVED_KV_CACHE_NAMES:
            home = _home_of(name)
            if home is not None:
                return vars(home)[name]
        if previous is not None:
            return previous(name)
        raise AttributeError(f"module {KV_CACHE_UTILS!r} has no attribute {name!r}")

    __getattr__.speculators_compat_patch = "kv-cache-planning-names"
    return __getattr__


def _probe_moved_names(current):
    import importlib
    import importlib.util

    kcu = sys.modules.get(KV_CACHE_UTILS)
    if kcu is None:
        return f"expected {KV_CACHE_UTILS} to be imported; it is not"
    if all(n in vars(kcu) for n in MOVED_KV_CACHE_NAMES):
        return NotNeeded(f"this vLLM defines {', '.join(MOVED_KV_CACHE_NAMES)} in {KV_CACHE_UTILS}")
    if current is not MISSING and not callable(current):
        return f"expected {KV_CACHE_UTILS}.__getattr__ to be absent or callable; found {current!r}"
    missing = [n for n in MOVED_KV_CACHE_NAMES if n not in vars(kcu)]
    for home in KV_CACHE_HOMES:
        module = sys.modules.get(home)
        if module is None:
            try:
                if importlib.util.find_spec(home) is None:
                    continue
            except (ImportError, ValueError):
                continue
            module = importlib.import_module(home)
        if getattr(getattr(module, "__spec__", None), "_initializing", False):
            return None  # being imported right now (it imports kv_cache_utils): names resolve at first use
        missing = [n for n in missing if n not in vars(module)]
    if missing:
        return (
            f"expected {', '.join(missing)} in {KV_CACHE_UTILS} or {', '.join(KV_CACHE_HOMES)}; found in neither"
        )
    return None


PATCHES = [
    Patch(
        id="kv-cache-planning-names",
        family="speculators-import",
        hook_module=KV_CACHE_UTILS,
        attribute="__getattr__",
        build=_build_moved_names,
        probe=_probe_moved_names,
    ),
    Patch(
        id="attn-mask-utils-stand-in",
        family="speculators-import",
        hook_module="transformers",
        attribute="modeling_attn_mask_utils",
        build=_build_mask_module,
        probe=_probe_mask_module,
        module_alias=_MASK_MODULE,
    ),
    Patch(
        id="hashing-module-alias",
        family="speculators-import",
        hook_module="vllm.utils",
        attribute="hashing",
        build=_build_hashing_module,
        probe=_probe_hashing,
        module_alias="vllm.utils.hashing",
    ),
    Patch(
        id="speculators-import-torch-annotation",
        family="speculators-import",
        hook_module=_TARGET,
        attribute="torch",
        build=_build,
        probe=_probe,
    )
]
