"""Load and validate compat_matrix.yaml, the one source of version truth.

The file is data only: read with a safe YAML loader (that also refuses duplicate keys, which
``yaml.safe_load`` would silently collapse), validated against a fixed schema, and turned into
plain records. Nothing in it names code to run. The schema is documented at the top of the
shipped file.

Where it is read from: ``SPECULATORS_COMPAT_MATRIX`` (a user's file, validated the same way),
else the copy packaged inside the wheel, else the repository's top-level file (editable
installs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from .versions import in_range, normalize, parse_specifier

__all__ = [
    "MatrixError",
    "PatchRange",
    "TestedPair",
    "Matrix",
    "load_matrix",
    "matrix_path",
    "VERSIONED_PACKAGES",
    "TESTED_STATUSES",
]

SCHEMA_VERSION = 1
VERSIONED_PACKAGES = ("speculators", "vllm", "transformers", "torch")
# stale: results exist, but from an earlier src/ tree (or without provenance): treated as untested
TESTED_STATUSES = ("verified", "broken", "untested", "stale")
_TOP_KEYS = {"schema", "patches", "tested", "not_applicable"}
_PATCH_KEYS = {"family", "why", *VERSIONED_PACKAGES}
_TESTED_KEYS = {"speculators", "vllm", "status", "platform", "evidence", "date", "commit"}
_NA_KEYS = {"speculators", "why"}


class MatrixError(ValueError):
    """The matrix file is malformed: the message names the file and the offending key."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False):
    seen: dict = {}
    for key_node, _value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise MatrixError(
                f"duplicate key {key!r} (line {key_node.start_mark.line + 1}; "
                f"first at line {seen[key] + 1})"
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


@dataclass(frozen=True)
class PatchRange:
    """Where one patch applies: a version range per package (absent = any) and why."""

    id: str
    family: str
    why: str
    ranges: dict[str, SpecifierSet] = field(default_factory=dict)

    def gate(self, versions: dict[str, str | None]) -> str | None:
        """None when every ranged package's installed version lies in range, else the reason."""
        for package, spec in self.ranges.items():
            version = versions.get(package)
            if version is None:
                return f"{package} is not installed (range {spec})"
            if not in_range(version, spec):
                return f"{package} {version} outside {spec}"
        return None


@dataclass(frozen=True)
class TestedPair:
    speculators: str
    vllm: str
    status: str
    platform: str = "cpu"
    evidence: str = ""
    date: str = ""
    commit: str = ""  # the commit(s) the evidence was produced at (scripts/update_tested.py)


@dataclass(frozen=True)
class Matrix:
    path: str
    patches: dict[str, PatchRange]
    tested: tuple[TestedPair, ...]
    not_applicable: tuple[tuple[SpecifierSet, str], ...]

    def not_applicable_reason(self, speculators_version: str | None) -> str | None:
        if speculators_version is None:
            return None
        for spec, why in self.not_applicable:
            if in_range(speculators_version, spec):
                return why
        return None

    def tested_status(self, speculators_version: str | None, vllm_version: str | None) -> list[TestedPair]:
        """Rows of the tested table for this (speculators, vLLM) pair (releases compared)."""
        if not speculators_version or not vllm_version:
            return []
        try:
            s, v = normalize(speculators_version), normalize(vllm_version)
        except InvalidVersion:
            return []
        return [
            row
            for row in self.tested
            if normalize(row.speculators) == s and normalize(row.vllm) == v
        ]

    def newest_tested_vllm(self) -> Version | None:
        versions = [normalize(r.vllm) for r in self.tested]
        return max(versions) if versions else None


def matrix_path() -> Path:
    """The matrix file in use: the user's (env), the packaged copy, or the repository's."""
    from .settings import text

    user = text("SPECULATORS_COMPAT_MATRIX")
    if user:
        return Path(user)
    packaged = Path(__file__).with_name("compat_matrix.yaml")
    if packaged.is_file():
        return packaged
    return Path(__file__).resolve().parents[2] / "compat_matrix.yaml"


def _require_mapping(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise MatrixError(f"{where}: expected a mapping, found {type(value).__name__}")
    return value


def _require_str(value, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise MatrixError(f"{where}: expected a non-empty string, found {value!r}")
    return value


def _check_keys(mapping: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(map(str, mapping)) - allowed)
    if unknown:
        raise MatrixError(f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})")


def _version_string(value, where: str) -> str:
    # Only strings: YAML reads an unquoted 0.10 as the number 0.1, which would silently name
    # another release.
    if not isinstance(value, str):
        raise MatrixError(f"{where}: expected a quoted version string such as '0.12.0', found {value!r}")
    text = value
    try:
        Version(text)
    except InvalidVersion:
        raise MatrixError(f"{where}: {text!r} is not a version") from None
    return text


def parse_matrix(text: str, path: str = "<string>", known_ids: set[str] | None = None) -> Matrix:
    """Validate matrix text. ``known_ids``: the patch ids the code defines (both directions checked)."""
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except MatrixError as exc:
        raise MatrixError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise MatrixError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    top = _require_mapping(data, path)
    _check_keys(top, _TOP_KEYS, path)
    if top.get("schema") != SCHEMA_VERSION:
        raise MatrixError(f"{path}: key 'schema' must be {SCHEMA_VERSION}, found {top.get('schema')!r}")

    patches: dict[str, PatchRange] = {}
    for pid, body in _require_mapping(top.get("patches", {}), f"{path}: patches").items():
        where = f"{path}: patches.{pid}"
        body = _require_mapping(body, where)
        _check_keys(body, _PATCH_KEYS, where)
        for required in ("family", "why"):
            if required not in body:
                raise MatrixError(f"{where}: missing key {required!r}")
        ranges = {
            pkg: _spec(body[pkg], f"{where}.{pkg}") for pkg in VERSIONED_PACKAGES if pkg in body
        }
        patches[str(pid)] = PatchRange(
            id=str(pid),
            family=_require_str(body["family"], f"{where}.family"),
            why=_require_str(body["why"], f"{where}.why"),
            ranges=ranges,
        )

    if known_ids is not None:
        unknown = sorted(set(patches) - known_ids)
        if unknown:
            raise MatrixError(f"{path}: patches.{unknown[0]}: unknown patch id (no such patch in code)")
        missing = sorted(known_ids - set(patches))
        if missing:
            raise MatrixError(f"{path}: patches: no entry for patch id {missing[0]!r}")

    tested: list[TestedPair] = []
    seen_pairs: set[tuple] = set()
    for i, row in enumerate(top.get("tested") or []):
        where = f"{path}: tested[{i}]"
        row = _require_mapping(row, where)
        _check_keys(row, _TESTED_KEYS, where)
        for required in ("speculators", "vllm", "status"):
            if required not in row:
                raise MatrixError(f"{where}: missing key {required!r}")
        status = row["status"]
        if status not in TESTED_STATUSES:
            raise MatrixError(f"{where}.status: {status!r} is not one of {', '.join(TESTED_STATUSES)}")
        pair = TestedPair(
            speculators=_version_string(row["speculators"], f"{where}.speculators"),
            vllm=_version_string(row["vllm"], f"{where}.vllm"),
            status=status,
            platform=str(row.get("platform", "cpu")),
            evidence=str(row.get("evidence", "")),
            date=str(row.get("date", "")),
            commit=str(row.get("commit", "")),
        )
        key = (pair.speculators, pair.vllm, pair.platform)
        if key in seen_pairs:
            raise MatrixError(f"{where}: duplicate row for speculators {key[0]}, vllm {key[1]}, platform {key[2]}")
        seen_pairs.add(key)
        tested.append(pair)

    na: list[tuple[SpecifierSet, str]] = []
    for i, row in enumerate(top.get("not_applicable") or []):
        where = f"{path}: not_applicable[{i}]"
        row = _require_mapping(row, where)
        _check_keys(row, _NA_KEYS, where)
        if "speculators" not in row or "why" not in row:
            raise MatrixError(f"{where}: needs keys 'speculators' and 'why'")
        na.append((_spec(row["speculators"], f"{where}.speculators"), _require_str(row["why"], f"{where}.why")))

    return Matrix(path=path, patches=patches, tested=tuple(tested), not_applicable=tuple(na))


def _spec(value, where: str) -> SpecifierSet:
    if not isinstance(value, str):
        raise MatrixError(f"{where}: expected a specifier string such as '>=0.12', found {value!r}")
    try:
        return parse_specifier(value, where)
    except ValueError as exc:
        raise MatrixError(str(exc)) from None


def load_matrix(path: str | Path | None = None, known_ids: set[str] | None = None) -> Matrix:
    p = Path(path) if path is not None else matrix_path()
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise MatrixError(f"{p}: cannot read the matrix file ({exc.strerror or exc})") from None
    return parse_matrix(text, str(p), known_ids)
