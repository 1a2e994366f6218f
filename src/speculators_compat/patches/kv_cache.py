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
- 0.33: ``Executor.set_kv_cache_layout(layout_name, cp_kv_cache_interleave_size)`` gained a
  required parameter; vLLM's engine passes ``parallel_config.cp_kv_cache_interleave_size``
  (after ``adjust_dcp_kv_cache_interleave_size``, a no-op without a KV-transfer config, which the
  generator never has). ``resolve_layout`` calls it in the first of ``SET_LAYOUT_FORMS`` that
  binds to the installed signature; ``speculators-compat check`` binds the same forms, so a
  further change is reported as drift naming the parameter before any model is loaded.

Every call these patches make is declared in ``calls=`` (registry.Call) and bound by ``check``.
"""

from __future__ import annotations

from ..registry import Call, wrapper_patch
from ._signatures import GENERATOR, first_binding, import_attr, parameters, require_params

EXECUTOR = "vllm.v1.executor.multiproc_executor"
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
        executor_cls = import_attr("vllm.v1.executor.multiproc_executor", "MultiprocExecutor")
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
