"""Load and validate compat_matrix.yaml, the one source of version truth.

Data only: a safe YAML loader that refuses duplicate keys, anchors and aliases and files over
``MAX_BYTES``; a fixed schema; one-line bounded errors. Read from ``SPECULATORS_COMPAT_MATRIX``,
else the wheel's copy, else the repository's file. Details: docs/MODULES.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import reprlib

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
_PATCH_KEYS = {"why", *VERSIONED_PACKAGES}
MAX_BYTES = 1 << 20  # 1 MiB: the shipped file is ~20 KB
MAX_MESSAGE = 400  # characters of one error line
_TESTED_KEYS = {"speculators", "vllm", "status", "platform", "evidence", "date", "commit"}
_NA_KEYS = {"speculators", "why"}


class MatrixError(ValueError):
    """The matrix file is malformed: one line (at most ``MAX_MESSAGE`` characters) naming the
    file and the offending key."""

    def __init__(self, message: str):
        line = str(message).replace("\r", " ").replace("\n", " ")
        if len(line) > MAX_MESSAGE:
            line = line[: MAX_MESSAGE - 5] + " […]"
        super().__init__(line)


_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 80
_repr.maxlist = _repr.maxdict = _repr.maxtuple = _repr.maxset = 4
_repr.maxlevel = 2


def _q(value: object) -> str:
    """A bounded repr for error messages (never the repr of a whole large structure)."""
    return _repr.repr(value)


MAX_FLOW_DEPTH = 32  # [ { nesting: PyYAML's scanner slows quadratically with it


class _StrictLoader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML ships no types
    """SafeLoader that refuses duplicate mapping keys, anchors, aliases and deep [ { nesting."""

    def fetch_flow_collection_start(self, TokenClass: type) -> None:
        super().fetch_flow_collection_start(TokenClass)
        if self.flow_level > MAX_FLOW_DEPTH:
            raise MatrixError(f"line {self.line + 1}: nested deeper than {MAX_FLOW_DEPTH} levels")

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            kind = "alias" if isinstance(event, yaml.AliasEvent) else "anchor"
            raise MatrixError(
                f"line {event.start_mark.line + 1}: YAML {kind} {_q(event.anchor)} refused "
                "(the matrix allows no anchors or aliases)"
            )
        return super().compose_node(parent, index)


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: dict[Any, int] = {}
    for key_node, _value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise MatrixError(
                f"duplicate key {_q(key)} (line {key_node.start_mark.line + 1}; "
                f"first at line {seen[key] + 1})"
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


@dataclass(frozen=True)
class PatchRange:
    """Where one patch applies: a version range per package (absent = any) and why. (What it
    needs alongside it is declared with the patch: ``Patch.requires``.)"""

    id: str
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

    def tested_status(
        self, speculators_version: str | None, vllm_version: str | None, platform: str | None = None
    ) -> list[TestedPair]:
        """Rows of the tested table for this (speculators, vLLM) pair (releases compared); with
        ``platform`` (``versions.vllm_platform``), only the rows that ran on that platform."""
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
            and (platform is None or row.platform == platform)
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


def _require_mapping(value: object, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise MatrixError(f"{where}: expected a mapping, found {type(value).__name__}")
    return value


def _require_str(value: object, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise MatrixError(f"{where}: expected a non-empty string, found {_q(value)}")
    return value


def _optional_text(row: dict[str, Any], key: str, default: str, where: str) -> str:
    """A free-text field of a tested row: a scalar (a YAML date is read as a date), never a container."""
    value = row.get(key, default)
    if isinstance(value, (dict, list)):
        raise MatrixError(f"{where}.{key}: expected text, found a {type(value).__name__}")
    return str(value)


def _check_keys(mapping: dict[str, Any], allowed: set[str], where: str, hint: dict[str, str] | None = None) -> None:
    unknown = sorted(set(map(str, mapping)) - allowed)
    if unknown:
        extra = f"; {hint[unknown[0]]}" if hint and unknown[0] in hint else ""
        raise MatrixError(f"{where}: unknown key {_q(unknown[0])} (allowed: {', '.join(sorted(allowed))}){extra}")


_PATCH_KEY_HINTS = {
    "family": "a patch's family is declared in its code (Patch.family), not here",
    "requires": "a patch's dependencies are declared in its code (Patch.requires), not here",
}


def _version_string(value: object, where: str) -> str:
    # Only strings: YAML reads an unquoted 0.10 as the number 0.1, which would silently name
    # another release.
    if not isinstance(value, str):
        raise MatrixError(f"{where}: expected a quoted version string such as '0.12.0', found {_q(value)}")
    text = value
    try:
        Version(text)
    except InvalidVersion:
        raise MatrixError(f"{where}: {_q(text)} is not a version") from None
    return text


def parse_matrix(text: str, path: str = "<string>", known_ids: set[str] | None = None) -> Matrix:
    """Validate matrix text. ``known_ids``: the patch ids the code defines (both directions checked)."""
    if len(text) > MAX_BYTES:
        raise MatrixError(f"{path}: {len(text)} characters, over the {MAX_BYTES}-byte limit of a matrix file")
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except MatrixError as exc:
        raise MatrixError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise MatrixError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    except RecursionError:
        raise MatrixError(f"{path}: not valid YAML: nested too deeply") from None
    top = _require_mapping(data, path)
    _check_keys(top, _TOP_KEYS, path)
    if top.get("schema") != SCHEMA_VERSION:
        raise MatrixError(f"{path}: key 'schema' must be {SCHEMA_VERSION}, found {_q(top.get('schema'))}")

    patches: dict[str, PatchRange] = {}
    for pid, body in _require_mapping(top.get("patches", {}), f"{path}: patches").items():
        if not isinstance(pid, str):
            raise MatrixError(f"{path}: patches: patch id {_q(pid)} is not a string")
        where = f"{path}: patches.{_q(pid)[1:-1]}"
        body = _require_mapping(body, where)
        _check_keys(body, _PATCH_KEYS, where, _PATCH_KEY_HINTS)
        if "why" not in body:
            raise MatrixError(f"{where}: missing key 'why'")
        ranges = {
            pkg: _spec(body[pkg], f"{where}.{pkg}") for pkg in VERSIONED_PACKAGES if pkg in body
        }
        patches[pid] = PatchRange(
            id=pid,
            why=_require_str(body["why"], f"{where}.why"),
            ranges=ranges,
        )

    if known_ids is not None:
        unknown = sorted(set(patches) - known_ids)
        if unknown:
            raise MatrixError(f"{path}: patches.{unknown[0]}: unknown patch id (no such patch in code)")
        missing = sorted(known_ids - set(patches))
        if missing:
            raise MatrixError(f"{path}: patches: no entry for patch id {_q(missing[0])}")

    tested: list[TestedPair] = []
    seen_pairs: set[tuple[str, str, str]] = set()
    for i, row in enumerate(top.get("tested") or []):
        where = f"{path}: tested[{i}]"
        row = _require_mapping(row, where)
        _check_keys(row, _TESTED_KEYS, where)
        for required in ("speculators", "vllm", "status"):
            if required not in row:
                raise MatrixError(f"{where}: missing key {required!r}")
        status = row["status"]
        if not isinstance(status, str) or status not in TESTED_STATUSES:
            raise MatrixError(f"{where}.status: {_q(status)} is not one of {', '.join(TESTED_STATUSES)}")
        pair = TestedPair(
            speculators=_version_string(row["speculators"], f"{where}.speculators"),
            vllm=_version_string(row["vllm"], f"{where}.vllm"),
            status=status,
            platform=_optional_text(row, "platform", "cpu", where),
            evidence=_optional_text(row, "evidence", "", where),
            date=_optional_text(row, "date", "", where),
            commit=_optional_text(row, "commit", "", where),
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


def _spec(value: object, where: str) -> SpecifierSet:
    if not isinstance(value, str):
        raise MatrixError(f"{where}: expected a specifier string such as '>=0.12', found {_q(value)}")
    try:
        return parse_specifier(value, where)
    except ValueError as exc:
        raise MatrixError(str(exc)) from None


def load_matrix(path: str | Path | None = None, known_ids: set[str] | None = None) -> Matrix:
    p = Path(path) if path is not None else matrix_path()
    try:
        with open(p, "rb") as f:
            data = f.read(MAX_BYTES + 1)  # bounded even where stat() lies (pipes, /proc)
    except OSError as exc:
        raise MatrixError(f"{p}: cannot read the matrix file ({exc.strerror or exc})") from None
    if len(data) > MAX_BYTES:
        raise MatrixError(f"{p}: over the {MAX_BYTES}-byte limit of a matrix file; refused unread")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MatrixError(f"{p}: not UTF-8 text (byte {exc.start})") from None
    return parse_matrix(text, str(p), known_ids)
