"""Patch records, their two gates (matrix + probe), apply/revert, ownership and status.

A target's import runs its patches' gates (compat_matrix.yaml, then the probe of the real
objects); only if both pass is the attribute replaced. One owner per attribute (``PatchConflict``
at registration); declared ``requires`` hold at selection; applying twice is a no-op; ``revert``
puts back the very object; an error in a hook never breaks the target's import (raised only in
strict mode or for a patch selected by name). Details: docs/MODULES.md.
"""

from __future__ import annotations

import logging
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("speculators_compat")

__all__ = [
    "MISSING",
    "Call",
    "NotNeeded",
    "Patch",
    "PatchConflict",
    "PatchError",
    "PatchStatus",
    "DriftError",
    "Registry",
    "wrapper_patch",
]


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


MISSING: Any = _Missing()


class NotNeeded(str):
    """A probe's verdict that the real object already has the shape the patch would give it
    (e.g. a module the patch stands in for still exists): the patch is skipped, not failed."""


class PatchConflict(ValueError):
    """Two patches claim one attribute."""


class PatchError(RuntimeError):
    """A patch could not be applied and the user asked for it to be fatal."""


@dataclass(frozen=True)
class Call:
    """One call into vLLM that a patch makes, or that the speculators code it keeps makes.

    ``attr`` dotted (``Class.method``; a class: its constructor); ``args`` passed positionally
    (their count binds); ``kwargs`` the keyword names; ``speculators`` a specifier limiting the
    call to those releases; ``optional``: called only where it exists. ``check`` binds each
    declared call against the installed signature (drift names it); a probe binds those its
    patch cannot work without (``calls_problem``), the rest are check's alone.
    """

    module: str
    attr: str
    args: tuple[str, ...] = ()
    kwargs: tuple[str, ...] = ()
    speculators: str = ""
    optional: bool = False

    @property
    def target(self) -> str:
        return f"{self.module}.{self.attr}"

    def describe(self) -> str:
        return f"{self.attr}({', '.join(self.args + tuple(f'{k}=' for k in self.kwargs))})"


# ``Patch.calls`` entries: a Call, or a tuple of Calls = the forms the patch chooses between by the
# installed signature (one of them must bind).
CallSpec = "Call | tuple[Call, ...]"

ProbeFn = Callable[[Any], "str | None"]
BuildFn = Callable[[Any], Any]


@dataclass
class Patch:
    """One patch on one attribute.

    ``hook_module``: the module whose import triggers the patch. ``owner``: (module, dotted
    attribute) that is replaced; defaults to an attribute of ``hook_module``. ``probe(current)``
    inspects the real objects and returns None when they look as the patch expects, else
    "expected ...; found ...". ``build(current)`` returns the replacement (``current`` is
    ``MISSING`` for an attribute the patch adds).
    """

    id: str
    family: str
    hook_module: str
    attribute: str
    build: BuildFn
    probe: ProbeFn
    owner_module: str | None = None
    doc: str = ""
    module_alias: str | None = None  # a module the patch registers in sys.modules (stand-ins)
    calls: tuple[Any, ...] = ()  # Call | tuple[Call, ...] (alternative forms): the vLLM calls made; bound by check
    requires: tuple[str, ...] = ()  # patch ids this one needs applied where they are in range
    script_target: bool = False  # the target exists only while a script runs: check binds its calls anyway

    @property
    def owner(self) -> tuple[str, str]:
        return (self.owner_module or self.hook_module, self.attribute)

    @property
    def target(self) -> str:
        module, attribute = self.owner
        return f"{module}:{attribute}"

    @property
    def requires_where(self) -> str:
        """Where ``requires`` is declared: the module that defines the patch's probe."""
        return getattr(self.probe, "__module__", None) or "code"


def wrapper_patch(
    id: str,
    family: str,
    module: str,
    attribute: str,
    wrapper: Callable[..., Any],
    probe: ProbeFn,
    doc: str = "",
    calls: tuple[Any, ...] = (),
    requires: tuple[str, ...] = (),
) -> Patch:
    """A patch that wraps ``module:attribute`` with a wrapt wrapper(wrapped, instance, args, kwargs)."""
    import wrapt

    def build(original: Any) -> Any:
        if original is MISSING:
            raise AttributeError(f"{module}:{attribute} does not exist")
        return wrapt.FunctionWrapper(original, wrapper)

    return Patch(id=id, family=family, hook_module=module, attribute=attribute, build=build, probe=probe, doc=doc,
                 calls=calls, requires=tuple(requires))


@dataclass
class PatchStatus:
    id: str
    family: str
    target: str
    status: str  # pending | applied | skipped | failed | reverted | disabled
    reason: str = ""
    versions: dict[str, str | None] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "family": self.family,
            "target": self.target,
            "status": self.status,
            "reason": self.reason,
            "versions": dict(self.versions),
        }


@dataclass
class _Applied:
    parent: Any
    attribute: str
    slot: Any  # what was in parent.__dict__ (MISSING if the attribute came from elsewhere)
    replacement: Any


def _live(parent: Any, attribute: str) -> Any:
    """The object stored under ``attribute`` (class attributes: unbound, as stored)."""
    try:
        return vars(parent)[attribute]
    except (TypeError, KeyError):
        return getattr(parent, attribute, MISSING)


def _resolve_parent(module_name: str, dotted: str) -> tuple[Any, str]:
    obj = sys.modules[module_name]
    *path, last = dotted.split(".")
    for part in path:
        obj = getattr(obj, part)
    return obj, last


class Registry:
    """Holds the patches, the configuration of one activation, and their statuses."""

    def __init__(self, matrix_loader: Callable[[set[str]], Any], versions_reader: Callable[[], dict[str, Any]], hooks: Any = None):
        if hooks is None:
            from ._import_hooks import HOOKS as hooks
        self._hooks = hooks
        self._matrix_loader = matrix_loader
        self._versions_reader = versions_reader
        self._patches: dict[str, Patch] = {}
        self._owners: dict[tuple[str, str], str] = {}
        self._status: dict[str, PatchStatus] = {}
        self._applied: dict[str, _Applied] = {}
        self._hooked_modules: set[str] = set()
        self._warned: set[str] = set()
        self._lock = threading.RLock()
        self.active = False
        self.strict = False
        self.selected: set[str] | None = None  # ids the user asked for by name
        self.excluded: set[str] = set()
        self._matrix: Any = None
        self._versions: dict[str, Any] | None = None
        self._combination_checked = False
        self._combination_problem: str | None = None

    # -- registration -------------------------------------------------------------------
    def register(self, patch: Patch) -> None:
        with self._lock:
            if patch.id in self._patches:
                raise PatchConflict(f"patch id {patch.id!r} is registered twice")
            if patch.id in patch.requires or len(set(patch.requires)) != len(patch.requires):
                raise PatchConflict(f"patch {patch.id!r}: requires {list(patch.requires)} lists itself or an id twice")
            owner = patch.owner
            if owner in self._owners:
                raise PatchConflict(
                    f"patch {patch.id!r} targets {patch.target}, already owned by patch {self._owners[owner]!r}"
                )
            self._patches[patch.id] = patch
            self._owners[owner] = patch.id
            self._status[patch.id] = PatchStatus(patch.id, patch.family, patch.target, "pending", "target not imported yet")

    @property
    def patches(self) -> dict[str, Patch]:
        return dict(self._patches)

    # -- configuration ------------------------------------------------------------------
    @property
    def matrix(self) -> Any:
        if self._matrix is None:
            self._matrix = self._matrix_loader(set(self._patches))
        return self._matrix

    @property
    def versions(self) -> dict[str, Any]:
        if self._versions is None:
            self._versions = self._versions_reader()
        return self._versions

    def version_strings(self) -> dict[str, str | None]:
        return {name: inst.version for name, inst in self.versions.items()}

    def configure(self, strict: bool, selection: str | None) -> None:
        """``selection``: "id1,id2" (only these, asked for by name) or "-id1,-id2" (all but these)."""
        self.strict = strict
        self.selected, self.excluded = None, set()
        if not selection or not selection.strip():
            return
        items = [s.strip() for s in selection.split(",") if s.strip()]
        negative = [s[1:] for s in items if s.startswith("-")]
        positive = [s for s in items if not s.startswith("-")]
        if negative and positive:
            raise ValueError(
                f"SPECULATORS_COMPAT_PATCHES={selection!r}: mix of selected and excluded ids; use one kind"
            )
        for pid in negative + positive:
            if pid not in self._patches:
                raise ValueError(
                    f"SPECULATORS_COMPAT_PATCHES names unknown patch id {pid!r} "
                    f"(known: {', '.join(sorted(self._patches))})"
                )
        selected = set(positive) if positive else None
        self._check_requires(selection, selected, set(negative))
        self.selected, self.excluded = selected, set(negative)

    def _in_range(self, pid: str, matrix: Any, versions: dict[str, Any]) -> bool:
        if matrix.not_applicable_reason(versions.get("speculators")):
            return False
        return matrix.patches[pid].gate(versions) is None

    def _check_requires(self, selection: str, selected: set[str] | None, excluded: set[str]) -> None:
        """A selection may not leave out a patch that a selected patch requires, where both are
        in range for the installed versions (a requirement ranged out is not needed there)."""
        from .matrix import MatrixError

        try:
            matrix = self.matrix
        except MatrixError:
            return  # every patch fails with the matrix's own error when it is tried
        versions = self.version_strings()

        def chosen(pid: str) -> bool:
            return pid not in excluded and (selected is None or pid in selected)

        for pid in sorted(self._patches):
            needed = self._patches[pid].requires
            if not needed or pid not in matrix.patches or not chosen(pid) or not self._in_range(pid, matrix, versions):
                continue
            for dep in needed:
                if dep not in self._patches:
                    raise ValueError(f"patch {pid!r} requires {dep!r}, which is not a registered patch")
                if not chosen(dep) and dep in matrix.patches and self._in_range(dep, matrix, versions):
                    how = "excludes" if dep in excluded else "does not select"
                    raise ValueError(
                        f"SPECULATORS_COMPAT_PATCHES={selection!r} {how} {dep!r}, which patch {pid!r} requires "
                        f"(declared with {pid!r} in {self._patches[pid].requires_where}); leave out {pid!r} too, or keep {dep!r}"
                    )

    def _explicit(self, pid: str) -> bool:
        return self.selected is not None and pid in self.selected

    # -- activation ---------------------------------------------------------------------
    @property
    def hook_modules(self) -> list[str]:
        return list(dict.fromkeys(p.hook_module for p in self._patches.values()))

    def activate(self) -> None:
        """Subscribe to every target module's import (persistently), and apply now to those
        already imported. Idempotent: applying twice is a no-op."""
        with self._lock:
            self.active = True
            for module in self.hook_modules:
                if module not in self._hooked_modules:
                    self._hooked_modules.add(module)
                    self._hooks.subscribe(module, self._on_import)
            for module in self.hook_modules:
                if module in sys.modules:
                    self._on_import(sys.modules[module])

    def retry(self, pid: str) -> None:
        """Gate and probe one patch again now: for a target defined after its hook module's
        import (a script's functions). A no-op while inactive, once applied, or before the hook
        and owner modules' import."""
        with self._lock:
            patch = self._patches.get(pid)
            if self.active and patch is not None and {patch.hook_module, patch.owner[0]} <= sys.modules.keys():
                self._try_apply(patch)

    def retry_failed(self) -> None:
        """``retry`` every patch whose gate, probe or build failed (``check`` asks again); one
        applied, then lost stays reported as such."""
        for pid in [pid for pid, st in self._status.items() if st.status == "failed"]:
            try:
                self.retry(pid)
            except PatchError:  # strict or explicitly selected: it stays failed, with its reason
                pass

    def deactivate(self) -> None:
        with self._lock:
            self.active = False
            for module in self._hooked_modules:
                self._hooks.unsubscribe(module, self._on_import)
            self._hooked_modules.clear()
            for pid in reversed(list(self._applied)):
                self._revert(pid)

    def _on_import(self, module: Any) -> None:
        """Post-import hook. Must never raise unless strict/explicit (that breaks the import)."""
        with self._lock:
            if not self.active:
                return
            for patch in self._patches.values():
                if patch.hook_module == module.__name__:
                    self._try_apply(patch)

    def _try_apply(self, patch: Patch) -> None:
        try:
            self._check_combination()
            self._apply(patch)
        except Exception as exc:  # noqa: BLE001 - recorded, warned, raised only when asked
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else f"{type(exc).__name__} (no message)"
            self._set(patch, "failed", reason)
            self._warn_once(patch.id, f"speculators_compat: patch {patch.id} on {patch.target} failed: {reason}")
            if self.strict or self._explicit(patch.id):
                raise PatchError(f"patch {patch.id} on {patch.target} failed: {reason}") from exc

    def _check_combination(self) -> None:
        """Warn once about an untested/broken (speculators, vLLM) pair; in strict mode refuse
        every patch for it, not only the first one tried."""
        if not self._combination_checked:
            self._combination_checked = True
            self._combination_problem = self._combination_message()
            if self._combination_problem:
                logger.warning(self._combination_problem)
        if self._combination_problem and self.strict:
            raise PatchError(f"strict mode: {self._combination_problem}")

    def tested_rows(self, everywhere: bool = False) -> tuple[str | None, list[Any]]:
        """The installed vLLM build's platform (``cpu`` / ``cuda``) and the tested table's rows for
        the installed pair on it (``everywhere``: on every platform). ``check``, ``report`` and the
        untested-pair warning all judge a pair by these rows."""
        from .versions import vllm_platform

        v = self.version_strings()
        platform = vllm_platform(self.versions["vllm"])
        rows = self.matrix.tested_status(v.get("speculators"), v.get("vllm"), None if everywhere else platform)
        return platform, rows

    def _combination_message(self) -> str | None:
        v = self.version_strings()
        spec, vllm = v.get("speculators"), v.get("vllm")
        if spec is None or vllm is None:
            return None
        platform, rows = self.tested_rows()
        if not rows or all(r.status == "untested" for r in rows):
            return (
                f"speculators {spec} with vLLM {vllm} ({platform}) is not in the tested table of {self.matrix.path}; "
                "patches are applied where their probes pass (run `speculators-compat check`)"
            )
        if any(r.status == "broken" for r in rows):
            return f"speculators {spec} with vLLM {vllm} is marked broken in {self.matrix.path}"
        return None

    def _apply(self, patch: Patch) -> None:
        pid = patch.id
        if self.selected is not None and pid not in self.selected:
            self._set(patch, "skipped", "not selected by SPECULATORS_COMPAT_PATCHES")
            return
        if pid in self.excluded:
            self._set(patch, "skipped", "excluded by SPECULATORS_COMPAT_PATCHES")
            return
        versions = self.version_strings()
        na = self.matrix.not_applicable_reason(versions.get("speculators"))
        if na:
            self._set(patch, "skipped", f"not applicable: {na}")
            return
        gate = self.matrix.patches[pid].gate(versions)
        if gate is not None:
            self._set(patch, "skipped", f"not needed: {gate}")
            return
        parent, attribute = _resolve_parent(*patch.owner)
        current = getattr(parent, attribute, MISSING)
        done = self._applied.get(pid)
        if done is not None:
            if done.parent is parent and _live(parent, attribute) is done.replacement:
                return  # applied twice: no-op
            # the module was reloaded (or someone replaced the attribute): forget the old record
            del self._applied[pid]
        problem = patch.probe(current)
        if isinstance(problem, NotNeeded):
            self._set(patch, "skipped", f"not needed: {problem}")
            return
        if problem:
            raise DriftError(f"probe failed: {problem}")
        slot = vars(parent).get(attribute, MISSING) if hasattr(parent, "__dict__") else MISSING
        replacement = patch.build(slot if slot is not MISSING else current)
        setattr(parent, attribute, replacement)
        if patch.module_alias is not None:  # a stand-in module: importable by its dotted name too
            sys.modules[patch.module_alias] = replacement
        self._applied[pid] = _Applied(parent, attribute, slot, replacement)
        why = self.matrix.patches[pid].why
        self._set(patch, "applied", why)
        logger.info("speculators_compat: applied %s on %s (%s)", pid, patch.target, why)

    def _revert(self, pid: str) -> None:
        done = self._applied.pop(pid, None)
        if done is None:
            return
        alias = self._patches[pid].module_alias
        if alias is not None and sys.modules.get(alias) is done.replacement:
            del sys.modules[alias]
        if _live(done.parent, done.attribute) is done.replacement:
            if done.slot is MISSING:
                delattr(done.parent, done.attribute)
            else:
                setattr(done.parent, done.attribute, done.slot)
        patch = self._patches[pid]
        self._set(patch, "reverted", "deactivate() restored the original")

    def revert(self, pid: str) -> None:
        with self._lock:
            self._revert(pid)

    def _set(self, patch: Patch, status: str, reason: str) -> None:
        self._status[patch.id] = PatchStatus(
            patch.id, patch.family, patch.target, status, reason, self.version_strings()
        )

    def _warn_once(self, key: str, message: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        logger.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    # -- reporting ----------------------------------------------------------------------
    def is_applied(self, pid: str) -> bool:
        """True while the patch's replacement is the live attribute (false after a reload)."""
        done = self._applied.get(pid)
        if done is None:
            return False
        alias = self._patches[pid].module_alias
        if alias is not None:  # a stand-in module: live while sys.modules holds it
            return sys.modules.get(alias) is done.replacement
        module_name, _ = self._patches[pid].owner
        try:
            parent, attribute = _resolve_parent(module_name, self._patches[pid].attribute)
        except (KeyError, AttributeError):
            return False
        return parent is done.parent and _live(parent, attribute) is done.replacement

    def statuses(self) -> list[PatchStatus]:
        out = []
        for pid, st in self._status.items():
            if st.status == "applied" and not self.is_applied(pid):
                lost = ("applied, then lost: the target was replaced after patching (assigned over, or the module "
                        "re-executed outside the import system); call activate() again")
                st = PatchStatus(st.id, st.family, st.target, "failed", lost, st.versions)
            out.append(st)
        return out

    def applied_ids(self) -> list[str]:
        return [pid for pid in self._applied if self.is_applied(pid)]


class DriftError(RuntimeError):
    """A probe found the real object different from what the patch expects."""
