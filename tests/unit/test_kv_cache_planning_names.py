"""kv-cache-planning-names: speculators' ``from vllm.v1.core.kv_cache_utils import ...`` of the three
helpers vLLM 0.33 moved to ``kv_cache_planning`` (stand-in modules with 0.32's and 0.33's layout)."""

from __future__ import annotations

import sys
import types

import pytest

from speculators_compat.patches import speculators_import as si
from speculators_compat.registry import MISSING, NotNeeded

pytestmark = pytest.mark.unit


def _fn(name):
    def f(*a):
        return name

    f.__name__ = name
    return f


@pytest.fixture
def layout(monkeypatch):
    def make(moved: bool, planning_has: bool = True):
        kcu = types.ModuleType(si.KV_CACHE_UTILS)
        planning = types.ModuleType(si.KV_CACHE_HOMES[0])
        kcu.init_none_hash = _fn("init_none_hash")
        for name in si.MOVED_KV_CACHE_NAMES:
            if not moved:
                setattr(kcu, name, _fn(name))
            elif planning_has:
                setattr(planning, name, _fn(name))
        for mod in ("vllm", "vllm.v1", "vllm.v1.core"):
            monkeypatch.setitem(sys.modules, mod, types.ModuleType(mod))
        monkeypatch.setitem(sys.modules, si.KV_CACHE_UTILS, kcu)
        monkeypatch.setitem(sys.modules, si.KV_CACHE_HOMES[0], planning)
        return kcu, planning

    return make


def test_before_033_the_names_are_there_and_the_patch_is_not_needed(layout):
    layout(moved=False)
    assert isinstance(si._probe_moved_names(MISSING), NotNeeded)


def test_033_the_import_fails_without_and_succeeds_with_the_patch(layout):
    kcu, planning = layout(moved=True)
    with pytest.raises(ImportError, match="_get_kv_cache_groups_uniform_spec"):
        exec("from vllm.v1.core.kv_cache_utils import _get_kv_cache_groups_uniform_spec", {})
    assert si._probe_moved_names(MISSING) is None
    kcu.__getattr__ = si._build_moved_names(MISSING)
    ns: dict = {}
    exec(
        "from vllm.v1.core.kv_cache_utils import (_get_kv_cache_groups_uniform_spec, "
        "get_kv_cache_config_from_groups, init_none_hash, unify_hybrid_kv_cache_specs)",
        ns,
    )
    for name in si.MOVED_KV_CACHE_NAMES:
        assert ns[name] is getattr(planning, name)  # vLLM's own object, not a copy
    with pytest.raises(AttributeError, match="no_such_name"):
        kcu.no_such_name  # noqa: B018 - other names still fail as before


def test_names_missing_everywhere_is_drift_naming_them(layout):
    layout(moved=True, planning_has=False)
    problem = si._probe_moved_names(MISSING)
    assert problem and not isinstance(problem, NotNeeded)
    assert all(n in problem for n in si.MOVED_KV_CACHE_NAMES) and "kv_cache_planning" in problem


def test_a_getattr_vllm_defines_itself_is_chained(layout):
    kcu, _ = layout(moved=True)
    kcu.__getattr__ = si._build_moved_names(lambda name: f"vllm's own {name}")
    assert kcu.something == "vllm's own something"
    assert kcu.unify_hybrid_kv_cache_specs() == "unify_hybrid_kv_cache_specs"
