"""scripts/bed.py's gate: an env whose modules do not import is never marked complete."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bed_under_test", ROOT / "scripts" / "bed.py")
bed = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bed)


def test_gate_modules_import_the_shim_first():
    mods = bed.envs.gate_modules("0.4.0.1", "0.32.0", True, ["pytest"])
    assert mods[0] == "speculators_compat" and mods.index("vllm") < mods.index("speculators")
    assert "speculators.data_generation.vllm_hidden_states_generator" in mods and mods[-1] == "pytest"
    # an env for training (no vLLM): speculators.data_generation imports vLLM, so only speculators
    assert bed.envs.gate_modules("0.4.0.1", "none", False, []) == ["speculators"]
    # a test tool is gated by its module, not its distribution's name (pytest-xdist imports as xdist)
    assert bed.envs.gate_modules("0.3.0", "0.16.0", False, ["pytest", "pytest-xdist", "matplotlib"])[-2:] == ["pytest", "xdist"]


def test_gate_passes_and_fails_for_real(tmp_path):
    runner = bed.envs.Runner(tmp_path / "bed.log")
    assert bed.envs.run_gate(runner, sys.executable, ["json", "pytest"]) is None
    why = bed.envs.run_gate(runner, sys.executable, ["json", "no_such_module_for_the_gate", "pytest"])
    assert why and why.startswith("no_such_module_for_the_gate: ModuleNotFoundError"), why


def test_reused_env_failing_the_gate_loses_its_marker(tmp_path, monkeypatch):
    """An env marked complete by an older bed.py (no gate) is gated on reuse; failing, it is
    unmarked and the call errors with the reason."""
    root = tmp_path / "envs"
    env = root / bed.envs.env_name("0.4.0.1", "0.32.0")
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").symlink_to(sys.executable)
    envs = bed.envs  # scripts/bedlib/envs.py: where ensure_env looks these up
    monkeypatch.setattr(envs, "recipe_hash", lambda s, v: "h")
    monkeypatch.setattr(envs, "find_uv", lambda: "uv")
    monkeypatch.setattr(envs, "ensure_vllm_alias", lambda env: None)
    monkeypatch.setattr(envs, "REPO", tmp_path)  # no pyproject: no self install
    (env / ".bed-complete").write_text(json.dumps({"hash": "h", "extras": [], "self": False}))
    # this interpreter has no vllm/speculators: the gate must fail
    with pytest.raises(bed.BedError, match="not usable"):
        bed.ensure_env("0.4.0.1", "0.32.0", root, [])
    assert not (env / ".bed-complete").exists()
