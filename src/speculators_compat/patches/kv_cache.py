"""KV-cache configuration built by hand in ``VllmHiddenStatesGenerator.__init__``.

What vLLM changed, and how the patches answer (versions: compat_matrix.yaml):
- ``get_kv_cache_config_from_groups`` lost its ``kv_cache_specs`` parameter in 0.12 (speculators
  0.3.0 passes it; 0.4.x does not, which 0.11 requires). The adapter binds the call against
  the real signature: it drops the argument where it is gone and, where it is required,
  rebuilds it from the groups (each group carries its spec and layer names).
- The KV-cache *layout* became an engine-level decision (0.29+ resolves it once:
  ``resolve_kv_cache_layout`` + executor ``set_kv_cache_layout``) that must precede building
  KV-cache configs ("KV cache layout has not been resolved yet"). The patch does what
  vLLM's own engine core does, right after the generator has built its executor and set up
  capture (``_setup_capture``), and stamps the resolved layout on the KV-cache config.
"""

from __future__ import annotations

from ..registry import wrapper_patch
from ._signatures import GENERATOR, accepts, import_attr, parameters, require_params


def _kv_cache_config_from_groups(wrapped, instance, args, kwargs):
    if accepts(wrapped, "kv_cache_specs"):
        if "kv_cache_specs" not in kwargs:
            groups = kwargs.get("kv_cache_groups", args[1] if len(args) > 1 else [])
            kwargs["kv_cache_specs"] = {
                name: group.kv_cache_spec for group in groups for name in group.layer_names
            }
    else:
        kwargs.pop("kv_cache_specs", None)
    config = wrapped(*args, **kwargs)
    vllm_config = kwargs.get("vllm_config", args[0] if args else None)
    layout = getattr(getattr(vllm_config, "cache_config", None), "kv_cache_layout", None)
    if layout is not None and getattr(config, "kv_cache_layout", "absent") is None:
        config.kv_cache_layout = layout
    return config


def _probe_kv_cache_config(current):
    real = import_attr("vllm.v1.core.kv_cache_utils", "get_kv_cache_config_from_groups")
    return require_params(real, ("vllm_config", "kv_cache_groups", "available_memory"), "get_kv_cache_config_from_groups")


def resolve_layout(executor, vllm_config) -> str | None:
    """vLLM's engine-core step: pick one KV-cache layout and tell the workers."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    specs = executor.get_kv_cache_specs()
    layout = resolve_kv_cache_layout(
        vllm_config,
        executor.get_supported_kv_cache_layouts(),
        [s for worker_specs in specs for s in worker_specs.values()],
    )
    executor.set_kv_cache_layout(layout.name)
    return layout.name


def _setup_capture_then_resolve_layout(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    resolve_layout(instance.executor, instance.vllm_config)
    return result


def _probe_layout(current):
    try:
        fn = import_attr("vllm.v1.attention.backends.utils", "resolve_kv_cache_layout")
        executor_cls = import_attr("vllm.v1.executor.multiproc_executor", "MultiprocExecutor")
    except (ImportError, AttributeError) as exc:
        return f"expected vllm.v1.attention.backends.utils.resolve_kv_cache_layout; found none ({exc})"
    problem = require_params(fn, ("vllm_config", "supported_layouts"), "resolve_kv_cache_layout")
    if problem:
        return problem
    for name in ("get_supported_kv_cache_layouts", "set_kv_cache_layout", "get_kv_cache_specs"):
        if not callable(getattr(executor_cls, name, None)):
            return f"expected MultiprocExecutor.{name}(); not found"
    if parameters(current) is None:
        return "expected VllmHiddenStatesGenerator._setup_capture to be a method"
    return None


PATCHES = [
    wrapper_patch(
        "kv-cache-config-args",
        "kv-cache",
        GENERATOR,
        "get_kv_cache_config_from_groups",
        _kv_cache_config_from_groups,
        _probe_kv_cache_config,
    ),
    wrapper_patch(
        "kv-cache-layout",
        "kv-cache",
        GENERATOR,
        "VllmHiddenStatesGenerator._setup_capture",
        _setup_capture_then_resolve_layout,
        _probe_layout,
    ),
]
