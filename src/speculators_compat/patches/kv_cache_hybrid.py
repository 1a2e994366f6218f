"""KV-cache groups of hybrid-attention models (Qwen3.5, Qwen3-Next, ...), planned by hand.

speculators unifies every layer's KV-cache spec, which fails for models mixing state-space /
linear-attention layers with attention (0.32: "Failed to promote local KV cache specs"). The
patches plan the groups as vLLM's engine does (``get_kv_cache_groups``), only for such models.
Versions: compat_matrix.yaml. Details: docs/MODULES.md.
"""

from __future__ import annotations

from ..registry import Call, wrapper_patch
from ._signatures import GENERATOR, calls_problem, first_binding, import_attr, parameters

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
    """The ``VllmConfig`` of the generator whose ``__init__`` is running (generator-construction marks it)."""
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
    return calls_problem((GROUPS_FORMS, UNIFORM_FORMS))


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
        # mixed specs reach it only when left un-unified; generator-construction marks the generator being built
        requires=("kv-cache-hybrid-unify", "generator-construction"),
    ),
]
