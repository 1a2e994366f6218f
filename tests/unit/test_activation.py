"""Activation: import-time cost, environment switches, the vLLM plugin entry point."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import wrapt
from _helpers import make_registry, subprocess_env

import speculators_compat
from speculators_compat import plugin
from speculators_compat.patches import all_patches
from speculators_compat.registry import Patch

pytestmark = pytest.mark.unit

HEAVY = ("torch", "vllm", "speculators", "transformers")


def _run(code: str, env: dict[str, str], timeout: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def heavy_stand_ins(tmp_path):
    """Importable stand-ins named torch, vllm, speculators, transformers: if anything imported
    them, they would show in sys.modules (whether or not the real ones are installed)."""
    root = tmp_path / "heavy"
    for name in HEAVY:
        pkg = root / name
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
    return root


def test_import_leaves_heavy_packages_unimported(heavy_stand_ins):
    code = f"""
        import json, sys
        import speculators_compat
        state = speculators_compat._STATE
        assert state.requested and state.lazy, "the import should activate the shim (a lazy hook)"
        speculators_compat.report()
        speculators_compat.context_line()
        # get_registry() builds the registry and has no side effect: nothing is activated
        assert not speculators_compat.get_registry().active and state.lazy
        heavy = {HEAVY!r}
        before = sorted(m for m in sys.modules if m.split(".")[0] in heavy)
        import torch, vllm, speculators, transformers  # the stand-ins: the check is not vacuous
        after = sorted(m for m in sys.modules if m.split(".")[0] in heavy)
        print(json.dumps([before, after]))
    """
    proc = _run(code, subprocess_env(PYTHONPATH=str(heavy_stand_ins)))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [[], sorted(HEAVY)]


def test_hook_modules_list_matches_the_patches():
    import speculators_compat

    assert set(speculators_compat.HOOK_MODULES) == {p.hook_module for p in all_patches()}


def test_import_subscribes_one_lazy_hook_then_the_registry_takes_over(tmp_path):
    """The import subscribes one lazy hook per target module on the package's one finder (wrapt
    is not even imported); the first import of a target builds and activates the registry,
    which then holds one hook per target module on the same finder, and the lazy hook is gone."""
    gen = tmp_path / "speculators" / "data_generation"
    gen.mkdir(parents=True)
    (tmp_path / "speculators" / "__init__.py").write_text("")
    (gen / "__init__.py").write_text("")
    (gen / "vllm_hidden_states_generator.py").write_text("MARK = 1\n")
    code = """
        import json, sys
        import speculators_compat
        from speculators_compat._import_hooks import HOOKS, ImportHooks
        state = {"wrapt_loaded": "wrapt" in sys.modules, "registry": speculators_compat._STATE.registry is not None,
                 "finders": [type(f).__name__ for f in sys.meta_path if isinstance(f, ImportHooks)],
                 "lazy": speculators_compat._STATE.lazy, "subscribed": HOOKS.subscribed()}
        import speculators.data_generation.vllm_hidden_states_generator as g
        reg = speculators_compat._STATE.registry
        state["after_registry"] = reg is not None and reg.active
        state["after_lazy"] = speculators_compat._STATE.lazy
        state["after_subscribed"] = HOOKS.subscribed()
        state["statuses"] = sorted({r["status"] for r in speculators_compat.report()
                                    if r["target"].startswith("speculators.data_generation.vllm_hidden")})
        state["module_ok"] = g.MARK == 1
        print(json.dumps(state))
    """
    proc = _run(code, subprocess_env(PYTHONPATH=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr
    state = json.loads(proc.stdout.strip().splitlines()[-1])
    assert state["wrapt_loaded"] is False and state["registry"] is False
    assert state["finders"] == ["ImportHooks"]
    assert state["lazy"] is True and state["subscribed"] == {m: 1 for m in speculators_compat.HOOK_MODULES}
    assert state["after_registry"] is True and state["module_ok"] is True and state["after_lazy"] is False
    # one registry hook per target module, the fired one included (hooks persist)
    assert state["after_subscribed"] == {p.hook_module: 1 for p in all_patches()}
    # the hook fired on the target's import: its patches were gated (not left pending)
    assert "pending" not in state["statuses"]


def test_disable_in_a_fresh_process_registers_nothing():
    code = """
        import json, sys
        import speculators_compat
        from speculators_compat._import_hooks import HOOKS, ImportHooks
        print(json.dumps({"hooks": HOOKS.subscribed(), "registry": speculators_compat._STATE.registry is None,
                          "finders": [type(f).__name__ for f in sys.meta_path if isinstance(f, ImportHooks)],
                          "activate": speculators_compat.activate()}))
    """
    proc = _run(code, subprocess_env(SPECULATORS_COMPAT_DISABLE="1"))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "hooks": {}, "registry": True, "finders": [], "activate": False
    }


def test_disable_makes_activate_return_false(clean_env, monkeypatch):
    monkeypatch.setattr(speculators_compat, "_STATE", speculators_compat._Activation())
    clean_env.setenv("SPECULATORS_COMPAT_DISABLE", "1")
    assert speculators_compat.activate() is False
    assert speculators_compat.activate(strict=True, patches="x") is False
    assert speculators_compat._STATE.registry is None and not speculators_compat._STATE.requested
    assert "SPECULATORS_COMPAT_STRICT" not in os.environ
    assert "SPECULATORS_COMPAT_PATCHES" not in os.environ


@pytest.fixture
def fake_global_registry(fake_modules, monkeypatch):
    """Swap the process-wide registry for one with a single patch on a fake module."""
    name = fake_modules.write("def f(x):\n    return x\n")
    patch = Patch(
        id="fake-patch",
        family="test",
        hook_module=name,
        attribute="f",
        build=lambda current: wrapt.FunctionWrapper(current, lambda w, i, a, k: ("patched", w(*a, **k))),
        probe=lambda current: None,
    )
    reg = make_registry([patch])
    state = speculators_compat._Activation()
    state.registry = reg
    monkeypatch.setattr(speculators_compat, "_STATE", state)
    return reg, name


def test_activate_strict_is_written_to_the_environment(clean_env, fake_global_registry):
    reg, _ = fake_global_registry
    assert speculators_compat.activate(strict=True) is True
    assert os.environ["SPECULATORS_COMPAT_STRICT"] == "1"
    assert reg.strict is True and reg.active is True
    speculators_compat.activate(strict=False)
    assert os.environ["SPECULATORS_COMPAT_STRICT"] == "0"
    assert reg.strict is False


def test_activate_reads_strict_and_patches_from_the_environment(clean_env, fake_global_registry):
    reg, _ = fake_global_registry
    clean_env.setenv("SPECULATORS_COMPAT_STRICT", "yes")
    clean_env.setenv("SPECULATORS_COMPAT_PATCHES", "-fake-patch")
    assert speculators_compat.activate() is True
    assert reg.strict is True
    assert reg.excluded == {"fake-patch"}


def test_activate_patches_is_written_to_the_environment(clean_env, fake_global_registry):
    reg, _ = fake_global_registry
    speculators_compat.activate(patches="fake-patch")
    assert os.environ["SPECULATORS_COMPAT_PATCHES"] == "fake-patch"
    assert reg.selected == {"fake-patch"}


def test_strict_env_reaches_a_child_process(clean_env, fake_global_registry):
    speculators_compat.activate(strict=True)
    proc = _run("import os; print(os.environ.get('SPECULATORS_COMPAT_STRICT'))", dict(os.environ))
    assert proc.stdout.strip() == "1"


def test_plugin_register_is_idempotent(clean_env, fake_global_registry):
    reg, name = fake_global_registry
    mod = importlib.import_module(name)
    original = mod.f
    for _ in range(5):
        plugin.register()
    replacement = mod.f
    assert replacement is not original and replacement.__wrapped__ is original
    plugin.register()
    assert mod.f is replacement
    assert mod.f(3) == ("patched", 3)
    assert reg.applied_ids() == ["fake-patch"]


def test_plugin_register_on_the_real_registry_many_times(clean_env):
    before = [s.as_dict() for s in speculators_compat.get_registry().statuses()]
    for _ in range(3):
        plugin.register()
    assert speculators_compat.get_registry() is speculators_compat.get_registry()
    assert [s.as_dict() for s in speculators_compat.get_registry().statuses()] == before


def test_deactivate_then_activate_through_the_package(clean_env, fake_global_registry):
    reg, name = fake_global_registry
    mod = importlib.import_module(name)
    original = mod.f
    speculators_compat.activate()
    assert mod.f is not original
    assert speculators_compat.context_line().endswith("patches applied here: fake-patch")
    speculators_compat.deactivate()
    assert mod.f is original
    assert speculators_compat.context_line().endswith("patches applied here: none")
    speculators_compat.activate()
    assert mod.f.__wrapped__ is original
    assert [r["status"] for r in speculators_compat.report()] == ["applied"]


def test_bad_patch_selection_is_a_one_line_error_at_import():
    proc = _run("import speculators_compat", subprocess_env(SPECULATORS_COMPAT_PATCHES="no-such-patch"))
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    known = ", ".join(sorted(p.id for p in all_patches()))
    assert last == (
        "ValueError: speculators_compat: SPECULATORS_COMPAT_PATCHES names unknown patch id "
        f"'no-such-patch' (known: {known})"
    )
    assert "During handling" not in proc.stderr
    assert "direct cause" not in proc.stderr


def test_mixed_patch_selection_is_a_one_line_error_at_import():
    ids = sorted(p.id for p in all_patches())
    value = f"{ids[0]},-{ids[1]}"
    proc = _run("import speculators_compat", subprocess_env(SPECULATORS_COMPAT_PATCHES=value))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"ValueError: speculators_compat: SPECULATORS_COMPAT_PATCHES={value!r}: mix of selected and "
        "excluded ids; use one kind"
    )


def test_strict_failure_at_the_first_target_re_arms_through_the_package(tmp_path):
    """The real lazy path in strict mode: the generator module's patches fail (here: the user's
    matrix file is missing), its import is refused; a retried import is refused again instead
    of succeeding unpatched (it succeeded silently with the one-shot trigger + wrapt hooks)."""
    gen = tmp_path / "speculators" / "data_generation"
    gen.mkdir(parents=True)
    (tmp_path / "speculators" / "__init__.py").write_text("")
    (gen / "__init__.py").write_text("")
    (gen / "vllm_hidden_states_generator.py").write_text("MARK = 1\n")
    code = """
        import json, sys, warnings
        warnings.simplefilter("ignore")
        import speculators_compat
        outcomes = []
        for _ in range(2):
            try:
                import speculators.data_generation.vllm_hidden_states_generator
                outcomes.append("imported")
            except Exception as exc:
                outcomes.append(type(exc).__name__)
        name = "speculators.data_generation.vllm_hidden_states_generator"
        print(json.dumps({"outcomes": outcomes, "in_sys_modules": name in sys.modules}))
    """
    env = subprocess_env(
        PYTHONPATH=str(tmp_path), SPECULATORS_COMPAT_STRICT="1", SPECULATORS_COMPAT_MATRIX=str(tmp_path / "none.yaml")
    )
    proc = _run(code, env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "outcomes": ["PatchError", "PatchError"],
        "in_sys_modules": False,
    }
