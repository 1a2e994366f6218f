"""Fixtures for the unit layer (helpers live in _helpers.py)."""

from __future__ import annotations

import os

import pytest
from _helpers import FakeModules


@pytest.fixture
def fake_modules(tmp_path, monkeypatch):
    """Small real modules with unique names in a directory on sys.path."""
    root = tmp_path / "fake_targets"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    fm = FakeModules(root)
    yield fm
    fm.cleanup()


@pytest.fixture
def clean_env(monkeypatch):
    """No SPECULATORS_COMPAT_* variables from the outer environment; afterwards exactly the outer
    ones again (activate() writes STRICT/PATCHES to os.environ itself, which monkeypatch cannot
    see: without this, a test's selection leaked into later tests)."""
    outer = {k: v for k, v in os.environ.items() if k.startswith("SPECULATORS_COMPAT_")}
    yield from _clean_env(monkeypatch)
    for key in [k for k in os.environ if k.startswith("SPECULATORS_COMPAT_")]:
        if key not in outer:
            del os.environ[key]
    os.environ.update(outer)


def _clean_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("SPECULATORS_COMPAT_"):
            monkeypatch.delenv(key)
    for key in (
        "SPECULATORS_COMPAT_DISABLE",
        "SPECULATORS_COMPAT_STRICT",
        "SPECULATORS_COMPAT_PATCHES",
        "SPECULATORS_COMPAT_MATRIX",
    ):
        monkeypatch.delenv(key, raising=False)
    yield monkeypatch
