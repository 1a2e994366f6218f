"""KV-cache groups of hybrid-attention models (state-space / linear-attention layers beside
attention layers: Qwen3.5, Qwen3-Next, ...), planned by hand in ``VllmHiddenStatesGenerator.__init__``.

What vLLM changed, and how the patches answer (versions: compat_matrix.yaml):
- speculators (0.3.0, 0.4.x) plans the KV cache as if every layer had one spec type: it calls
  ``unify_hybrid_kv_cache_specs(kv_cache_spec)`` and then ``_get_kv_cache_groups_uniform_spec``.
  Since vLLM gave linear-attention / Mamba-style layers their own ``MambaSpec`` (a recurrent state
  per request, v1 hybrid KV-cache manager) a model that mixes them with attention layers cannot
  be unified: 0.32 raises "Failed to promote local KV cache specs to one unified type" (e.g. 3
  ``MambaSpec`` + 1 ``FullAttentionSpec``), and past that "All layers in the same KV cache group
  must be the same". vLLM's own engine never unifies such a model (it does so only where
  ``scheduler_config.disable_hybrid_kv_cache_manager`` is set): ``EngineCore._initialize_kv_caches``
  → ``get_kv_cache_configs`` → ``get_kv_cache_groups(vllm_config, kv_cache_spec)``, which puts
  the attention and the state layers in separate groups of one page size.
- ``kv-cache-hybrid-unify`` wraps ``unify_hybrid_kv_cache_specs`` in the generator's module: where
  the specs mix ``MambaSpec`` layers with other layers it leaves them as they are (as vLLM's
  engine does), elsewhere it calls the original (unchanged path: sliding + full attention models
  such as gpt-oss are still unified to full attention, as speculators intends).
- ``kv-cache-hybrid-groups`` wraps ``_get_kv_cache_groups_uniform_spec`` there: for specs that
  are not one spec (``is_kv_cache_spec_uniform`` false: those mixed specs, and attention layers
  that still differ after unification, e.g. Gemma 3 on CUDA vLLM 0.24 where sliding-window layers
  index the cache by another block stride and the original asserts) it returns
  ``get_kv_cache_groups(vllm_config, kv_cache_spec)`` with the generator's own ``VllmConfig``
  (read off the generator whose ``__init__`` is calling: the wrapped function receives only the
  specs); a uniform model takes the original call.
  The rest follows as in vLLM's engine: ``get_kv_cache_config_from_groups`` lays the groups out
  (kv-cache-config-args), the scheduler takes its block sizes from the groups (scheduler-args:
  ``resolve_kv_cache_block_sizes``), and the model runner keeps each request's recurrent state
  across chunked-prefill steps.
``get_kv_cache_groups`` is taken from ``kv_cache_utils`` or, where vLLM moved the planning
functions (0.33), ``kv_cache_planning``: the first of ``GROUPS_FORMS`` that binds.
Every call these patches make is declared in ``calls=`` (registry.Call) and bound by ``check``.
Where this was run: CPU vLLM 0.32 (Qwen3.5 and Qwen3-Next cells, speculators 0.3.0 and 0.4.0.1,
benchmarks/results/arch/); not yet on another release - there the probes decide.
"""

from __future__ import annotations

from ..registry import Call, wrapper_patch
from ._signatures import GENERATOR, first_binding, import_attr, parameters

KV_UTILS = "vllm.v1.core.kv_cache_utils"
KV_PLANNING = "vllm.v1.core.kv_cache_planning"
SPECS = "vllm.v1.kv_cache_interface"

# get_kv_cache_groups(vllm_config, kv_cache_spec) as the groups adapter calls it: where it lives
GROUPS_FORMS = (
    Call(KV_UTILS, "get_kv_cache_groups", args=("vllm_config", "kv_cache_spec")),
    Call(KV_PLANNING, "get_kv_cache_groups", args=("vllm_config", "kv_cache_spec")),
)
UNIFORM_FORMS = (
    Call(KV_UTILS, "is_kv_cache_spec_uniform", args=("kv_cache_spec",)),
    Call(KV_PLANNING, "is_kv_cache_spec_uniform", args=("kv_cache_spec",)),
)

def _first(forms):
    form, problem = first_binding(forms)
    if form is None:
        raise TypeError(f"speculators_compat: no known call binds: {problem}")
    return import_attr(form.module, form.attr)


def is_mixed_state_model(kv_cache_spec) -> bool:
    """True where the specs mix ``MambaSpec`` (recurrent-state) layers with other layers: what
    speculators' single-type planning cannot handle and vLLM's engine groups separately."""
    mamba_spec = import_attr(SPECS, "MambaSpec")
    specs = list(dict(kv_cache_spec).values())
    n_state = sum(isinstance(s, mamba_spec) for s in specs)
    return 0 < n_state < len(specs)


def _unify_unless_mixed(wrapped, instance, args, kwargs):
    specs = kwargs.get("kv_cache_spec", args[0] if args else None)
    if specs is not None and is_mixed_state_model(specs):
        return None  # vLLM's engine keeps a hybrid model's specs as they are
    return wrapped(*args, **kwargs)


def calling_generator_config():
    """The ``VllmConfig`` of the generator whose ``__init__`` is running (executor-class marks it)."""
    from .executor import CONSTRUCTING

    owner = CONSTRUCTING.get()
    if owner is None or getattr(owner, "vllm_config", None) is None:
        raise RuntimeError(
            "speculators_compat: planning a hybrid model's KV-cache groups needs the generator's VllmConfig; "
            "expected _get_kv_cache_groups_uniform_spec to be called from VllmHiddenStatesGenerator.__init__ "
            "(after self.vllm_config is set); found no such caller"
        )
    return owner.vllm_config


def _groups_for_mixed(wrapped, instance, args, kwargs):
    specs = kwargs.get("kv_cache_spec", args[0] if args else None)
    if specs is None or _first(UNIFORM_FORMS)(specs):
        return wrapped(*args, **kwargs)
    # not one spec: state + attention layers, or attention layers that still differ after
    # speculators' unification (Gemma 3 on CUDA: sliding-window layers pick another backend
    # layout); the original can only fail there, vLLM's engine groups them
    return _first(GROUPS_FORMS)(calling_generator_config(), specs)


def _probe_common(current, what: str) -> str | None:
    if parameters(current) is None:
        return f"expected {GENERATOR}.{what} to be a function; found {current!r}"
    try:
        import_attr(SPECS, "MambaSpec")
    except (ImportError, AttributeError) as exc:
        return f"expected {SPECS}.MambaSpec; not found ({type(exc).__name__}: {exc})"
    for forms in (GROUPS_FORMS, UNIFORM_FORMS):
        problem = first_binding(forms)[1]
        if problem:
            return problem
    return None


def _probe_unify(current):
    return _probe_common(current, "unify_hybrid_kv_cache_specs")


def _probe_groups(current):
    problem = _probe_common(current, "_get_kv_cache_groups_uniform_spec")
    if problem:
        return problem
    try:
        cls = import_attr(GENERATOR, "VllmHiddenStatesGenerator")
    except (ImportError, AttributeError) as exc:
        return f"expected {GENERATOR}.VllmHiddenStatesGenerator; not found ({exc})"
    if not callable(getattr(cls, "__init__", None)):
        return "expected VllmHiddenStatesGenerator.__init__ to be the caller; not found"
    return None


PATCHES = [
    wrapper_patch(
        "kv-cache-hybrid-unify",
        "kv-cache",
        GENERATOR,
        "unify_hybrid_kv_cache_specs",
        _unify_unless_mixed,
        _probe_unify,
        calls=(),  # calls the original only; reads vllm.v1.kv_cache_interface.MambaSpec (probed)
    ),
    wrapper_patch(
        "kv-cache-hybrid-groups",
        "kv-cache",
        GENERATOR,
        "_get_kv_cache_groups_uniform_spec",
        _groups_for_mixed,
        _probe_groups,
        calls=(GROUPS_FORMS, UNIFORM_FORMS),
        # mixed specs reach it only when left un-unified; executor-class marks the generator being built
        requires=("kv-cache-hybrid-unify", "executor-class"),
    ),
]
