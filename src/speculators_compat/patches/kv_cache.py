"""KV-cache configuration built by hand in ``VllmHiddenStatesGenerator.__init__``.

``get_kv_cache_config_from_groups`` is called as the installed signature takes it (its
``kv_cache_specs`` went in 0.12); the KV-cache layout is resolved and set on the executor as
vLLM's engine core does (0.29+; 0.33's extra ``cp_kv_cache_interleave_size``) before configs are
built. Versions: compat_matrix.yaml. Details: docs/MODULES.md.
"""

from __future__ import annotations

from ..registry import Call, wrapper_patch
from ._signatures import EXECUTOR, GENERATOR, first_binding, import_attr, parameters, require_params

ATTN_UTILS = "vllm.v1.attention.backends.utils"

# get_kv_cache_config_from_groups as the adapter calls it: with kv_cache_specs where accepted (0.11)
KV_CONFIG_FORMS = (
    Call("vllm.v1.core.kv_cache_utils", "get_kv_cache_config_from_groups",
         kwargs=("vllm_config", "kv_cache_groups", "available_memory", "kv_cache_specs")),
    Call("vllm.v1.core.kv_cache_utils", "get_kv_cache_config_from_groups",
         kwargs=("vllm_config", "kv_cache_groups", "available_memory")),
)

# Executor.set_kv_cache_layout as resolve_layout calls it (first form that binds), newest first.
# The argument names say where each value comes from (see _LAYOUT_VALUES).
SET_LAYOUT_FORMS = (
    Call(EXECUTOR, "MultiprocExecutor.set_kv_cache_layout", args=("layout_name", "cp_kv_cache_interleave_size")),
    Call(EXECUTOR, "MultiprocExecutor.set_kv_cache_layout", args=("layout_name",)),
)
_LAYOUT_VALUES = {
    "layout_name": lambda layout, vllm_config: layout.name,
    "cp_kv_cache_interleave_size": lambda layout, vllm_config: vllm_config.parallel_config.cp_kv_cache_interleave_size,
}

LAYOUT_CALLS = (
    Call(ATTN_UTILS, "resolve_kv_cache_layout", args=("vllm_config", "supported_layouts", "kv_cache_specs")),
    Call(EXECUTOR, "MultiprocExecutor.get_supported_kv_cache_layouts"),
    Call(EXECUTOR, "MultiprocExecutor.get_kv_cache_specs"),
    SET_LAYOUT_FORMS,
)


def _kv_cache_config_from_groups(wrapped, instance, args, kwargs):
    form, problem = first_binding(KV_CONFIG_FORMS, wrapped)
    if form is None:
        raise TypeError(f"speculators_compat: no known call of get_kv_cache_config_from_groups binds: {problem}")
    if "kv_cache_specs" in form.kwargs:
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
    real = current if callable(current) else import_attr("vllm.v1.core.kv_cache_utils", "get_kv_cache_config_from_groups")
    return first_binding(KV_CONFIG_FORMS, real)[1]


def resolve_layout(executor, vllm_config) -> str | None:
    """vLLM's engine-core step: pick one KV-cache layout and tell the workers."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    specs = executor.get_kv_cache_specs()
    layout = resolve_kv_cache_layout(
        vllm_config,
        executor.get_supported_kv_cache_layouts(),
        [s for worker_specs in specs for s in worker_specs.values()],
    )
    form, problem = first_binding(SET_LAYOUT_FORMS, executor.set_kv_cache_layout)
    if form is None:
        raise TypeError(f"speculators_compat: no known call of set_kv_cache_layout binds: {problem}")
    executor.set_kv_cache_layout(*(_LAYOUT_VALUES[name](layout, vllm_config) for name in form.args))
    return layout.name


def _setup_capture_then_resolve_layout(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    resolve_layout(instance.executor, instance.vllm_config)
    return result


def _probe_layout(current):
    try:
        fn = import_attr("vllm.v1.attention.backends.utils", "resolve_kv_cache_layout")
        executor_cls = import_attr(EXECUTOR, "MultiprocExecutor")
    except (ImportError, AttributeError) as exc:
        return f"expected vllm.v1.attention.backends.utils.resolve_kv_cache_layout; found none ({exc})"
    problem = require_params(fn, ("vllm_config", "supported_layouts"), "resolve_kv_cache_layout")
    if problem:
        return problem
    for name in ("get_supported_kv_cache_layouts", "set_kv_cache_layout", "get_kv_cache_specs"):
        if not callable(getattr(executor_cls, name, None)):
            return f"expected MultiprocExecutor.{name}(); not found"
    form, problem = first_binding(SET_LAYOUT_FORMS)
    if form is None:
        return problem
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
        calls=(KV_CONFIG_FORMS,),
    ),
    wrapper_patch(
        "kv-cache-layout",
        "kv-cache",
        GENERATOR,
        "VllmHiddenStatesGenerator._setup_capture",
        _setup_capture_then_resolve_layout,
        _probe_layout,
        calls=LAYOUT_CALLS,
    ),
]
