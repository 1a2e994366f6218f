"""Command line: ``speculators-compat`` / ``python -m speculators_compat``.

- ``report [--json] [--matrix] [--import-targets] [--patch ID]``: versions found, every patch's gate
  and status (``--patch``: everything about one patch).
- ``check [--json] [--junit PATH]``: probes the installed vLLM/speculators (see check.py).
- ``run <command…>``: the command, with the shim active in every Python process (launcher.py).
- ``verify DIR [--quick] [--json]``: a data folder against its manifest (output.py).
- ``demo``: the test-bed demo (tiny model, real generator, HF reference); ``--version``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _versions_dict(reg) -> dict:
    return {
        name: {"distribution": inst.distribution, "version": inst.version}
        for name, inst in reg.versions.items()
    }


def _import_targets() -> list[str]:
    """Import speculators' generator and worker modules so that their hooks run (report only)."""
    errors = []
    for module in (
        "speculators.data_generation.vllm_hidden_states_generator",
        "speculators.data_generation.custom_worker",
    ):
        try:
            __import__(module)
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            errors.append(f"import {module}: {type(exc).__name__}: {exc}")
    return errors


def cmd_report(args) -> int:
    import speculators_compat
    from .matrix import MatrixError
    from .versions import vllm_platform

    reg = speculators_compat.get_registry()
    versions = reg.versions
    errors = _import_targets() if args.import_targets else []
    try:
        matrix = reg.matrix
        matrix_error = None
    except MatrixError as exc:
        matrix, matrix_error = None, str(exc)
    records = speculators_compat.report()
    gates = {}
    if matrix is not None:
        vs = reg.version_strings()
        for pid, rng in matrix.patches.items():
            gates[pid] = rng.gate(vs) or "in range"
    out: dict[str, Any] = {
        "speculators_compat": speculators_compat.__version__,
        "versions": _versions_dict(reg),
        "matrix": matrix.path if matrix else None,
        "matrix_error": matrix_error,
        "import_errors": errors,
        "tested": [r.__dict__ for r in reg.tested_rows()[1]] if matrix else [],
        "patches": [dict(r, gate=gates.get(r["id"], "")) for r in records],
    }
    if args.matrix and matrix is not None:
        out["tested_table"] = [r.__dict__ for r in matrix.tested]
    if args.json:
        print(json.dumps(out, indent=2))
        return 0 if matrix_error is None else 3
    print(f"speculators-compat {speculators_compat.__version__}")
    for inst in versions.values():
        print(f"  {inst}")
    print(f"  matrix: {out['matrix'] or matrix_error}")
    for e in errors:
        print(f"  ! {e}")
    if not versions["speculators"].present or not versions["vllm"].present:
        print("  (speculators or vLLM absent: patches stay pending until their targets are imported)")
    print()
    width = max([len(r["id"]) for r in records] + [10])
    print(f"{'patch':<{width}}  {'family':<18} {'status':<10} reason")
    for r in out["patches"]:
        status, reason = r["status"], r["reason"]
        if status == "pending":  # out of range: never applies here; in range: its target is not imported yet
            gate = r["gate"]
            status, reason = ("not needed", gate) if gate and gate != "in range" else (status, f"pending ({gate or 'gate unknown'})")
        print(f"{r['id']:<{width}}  {r['family']:<18} {status:<10} {reason}")
    print()
    for row in out["tested"] or [{"platform": vllm_platform(versions["vllm"]) or "-",
                                  "status": "not in the tested table" if matrix else "unknown (no matrix)", "evidence": ""}]:
        print(f"this pair, {row['platform']}: {row['status']} {row['evidence']}".rstrip())
    if errors == [] and args.import_targets:
        from .check import cpu_attention_findings

        for f in cpu_attention_findings(records):
            print(f"{f.name}: {f.status}: {f.detail}")
    if args.matrix and matrix is not None:
        print("\ntested combinations (generated from real runs):")
        for row in matrix.tested:
            print(f"  speculators {row.speculators:<8} vllm {row.vllm:<8} {row.platform:<5} {row.status:<9} {row.evidence}")
    return 0 if matrix_error is None else 3


def patch_facts(reg, pid: str) -> dict:
    """Everything about one patch, read from its declaration, its module and the matrix: target,
    family, gate (ranges, why), status, probe, the vLLM calls it declares, what it requires and
    is required by, the settings its module reads, and its module's account of what changed."""
    import inspect
    import re

    from .settings import SETTINGS

    patch = reg.patches.get(pid)
    if patch is None:
        raise ValueError(f"no patch {pid!r}; expected one of {', '.join(sorted(reg.patches))}")
    matrix = reg.matrix
    rng = matrix.patches.get(pid)
    status: dict[str, Any] = next((r for r in __import__("speculators_compat").report() if r["id"] == pid), {})
    probe_module = inspect.getmodule(patch.probe)
    source = inspect.getsource(probe_module) if probe_module else ""
    doc = (getattr(probe_module, "__doc__", "") or "").strip()
    return {
        "id": pid,
        "family": patch.family,
        "target": patch.target,
        "hook_module": patch.hook_module,
        "defined_in": getattr(probe_module, "__name__", None),
        "gate": {"ranges": {k: str(v) for k, v in (rng.ranges if rng else {}).items()},
                 "why": rng.why if rng else None,
                 "here": (rng.gate(reg.version_strings()) or "in range") if rng else "not in the matrix"},
        "status": status.get("status"), "reason": status.get("reason"),
        "probe": f"{patch.probe.__module__}.{patch.probe.__qualname__}",
        "probe_doc": (inspect.getdoc(patch.probe) or "").split("\n\n")[0] or None,
        "calls": [[c.target + " " + c.describe() for c in (spec if isinstance(spec, tuple) else (spec,))]
                  for spec in patch.calls],
        "requires": list(patch.requires),
        "required_by": sorted(q.id for q in reg.patches.values() if pid in q.requires),
        "settings": sorted(set(re.findall(r"SPECULATORS_COMPAT_[A-Z_]+", source)) & set(SETTINGS)),
        "module_doc": doc,
    }


def cmd_report_patch(args) -> int:
    import speculators_compat

    reg = speculators_compat.get_registry()
    if args.import_targets:
        _import_targets()
    facts = patch_facts(reg, args.patch)
    if args.json:
        print(json.dumps(facts, indent=2))
        return 0
    g = facts["gate"]
    print(f"{facts['id']}  ({facts['family']}; defined in {facts['defined_in']})")
    print(f"  target    {facts['target']}  (applied when {facts['hook_module']} is imported)")
    print(f"  gate      {', '.join(f'{k} {v}' for k, v in g['ranges'].items()) or 'any version'}: here {g['here']}")
    print(f"  why       {g['why']}")
    print(f"  status    {facts['status']}" + (f": {facts['reason']}" if facts["reason"] not in (None, "", g["why"]) else ""))
    print(f"  probe     {facts['probe']}" + (f": {facts['probe_doc']}" if facts["probe_doc"] else ""))
    for forms in facts["calls"] or [["(declares no call of its own)"]]:
        print(f"  calls     {' | '.join(forms)}")
    print(f"  requires  {', '.join(facts['requires']) or '-'}; required by {', '.join(facts['required_by']) or '-'}")
    print(f"  settings  {', '.join(facts['settings']) or '-'}")
    print("\n" + "\n".join("  " + ln for ln in facts["module_doc"].splitlines()))
    return 0


def cmd_rehearse(args) -> int:
    """``check --model``: exit 0 the rehearsal passes, 2 it fails, 3 it cannot run (one line why)."""
    try:
        from speculators_compat_testbed import rehearsal
    except ImportError as exc:
        return _cannot("check", ImportError(f"check --model needs the test bed (from a checkout: pip install ./testbed): {exc}"))
    try:
        ids = [int(x) for x in args.layer_ids.split(",")] if args.layer_ids else None
    except ValueError:
        return _cannot("check", ValueError(f"--layer-ids: expected comma-separated integers; found {args.layer_ids!r}"))
    try:
        result = rehearsal.rehearse(args.model, layer_ids=ids, tensor_parallel_size=args.tensor_parallel_size,
                                    max_model_len=args.max_model_len, dtype=args.dtype, workdir=args.keep)
    except (Exception, MemoryError) as exc:  # noqa: BLE001 - CannotRehearse and anything before the engine
        return _cannot("check", exc)
    print(json.dumps(result, indent=2, default=str) if args.json else rehearsal.render(result))
    return rehearsal.exit_code(result)


def _cannot(command: str, exc: BaseException) -> int:
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0][:300]}" if text else f"{type(exc).__name__} (no message)"
    verb = {"check": "check", "report": "report", "demo": "run the demo"}.get(command, command)
    print(f"speculators-compat {command}: cannot {verb}: {line}", file=sys.stderr)
    return 3


def main(argv: list[str] | None = None) -> int:
    import speculators_compat

    parser = argparse.ArgumentParser(prog="speculators-compat", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"speculators-compat {speculators_compat.__version__}")
    sub = parser.add_subparsers(dest="command")
    rep = sub.add_parser("report", help="versions found and every patch's status")
    rep.add_argument("--json", action="store_true", help="machine-readable output")
    rep.add_argument("--matrix", action="store_true", help="also show the tested table")
    rep.add_argument("--patch", default=None, metavar="ID",
                     help="everything about one patch: target, gate, status, probe, calls, requires, settings")
    rep.add_argument(
        "--import-targets",
        action="store_true",
        help="import speculators' generator and worker modules first (applies their patches; imports vLLM)",
    )
    chk = sub.add_parser("check", help="probe the installed vLLM/speculators (no model): exit 0 supported, 1 untested, 2 drift, 3 cannot check")
    chk.add_argument("--json", action="store_true")
    chk.add_argument("--junit", default=None, metavar="PATH", help="also write a JUnit XML report")
    chk.add_argument("--verbose", "-v", action="store_true", help="list passing checks too, and tracebacks in full")
    chk.add_argument("--model", default=None, metavar="PATH",
                     help="rehearse this model (its folder or config.json; no weights read): a shrunk copy of the "
                     "same architecture through speculators' generator on this machine, every row compared with HF")
    chk.add_argument("--layer-ids", default=None, help="with --model: the layer ids the real run captures (comma-separated)")
    chk.add_argument("--tensor-parallel-size", type=int, default=1, help="with --model: the real run's TP")
    chk.add_argument("--max-model-len", type=int, default=None, help="with --model: the real run's max model length")
    chk.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                     help="with --model: the engine dtype (auto: speculators' choice)")
    chk.add_argument("--keep", default=None, metavar="DIR", help="with --model: keep the shrunk model and raw result here")
    demo = sub.add_parser("demo", help="tiny model through speculators' generator, compared with HF")
    demo.add_argument("--arch", default="llama")
    demo.add_argument("--layers", default=None, help="comma-separated layer ids (default: speculators' choice)")
    demo.add_argument("--json", default=None, help="write the demo's measurements to this file")
    ver = sub.add_parser("verify", help="check a data folder against its manifest: exit 0 intact and complete, "
                         "1 defects or incomplete, 2 no manifest")
    ver.add_argument("folder")
    ver.add_argument("--quick", action="store_true", help="sizes only (no checksums: no file is read)")
    ver.add_argument("--json", action="store_true")
    sub.add_parser(
        "run",
        help="run a command (e.g. python data_generation_offline.py ...) with the shim active in it "
        "and in every Python process it starts",
        add_help=False,
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "run":  # everything after `run` is the command, options included
        from .launcher import run

        return run(argv[1:])
    args = parser.parse_args(argv)
    if args.command in ("report", "check", "demo"):
        try:  # a bad SPECULATORS_COMPAT_PATCHES (left quiet at the import of this command): one line, exit 3
            speculators_compat.activate()
        except ValueError as exc:
            return _cannot(args.command, exc)
    if args.command == "report":
        try:
            return cmd_report_patch(args) if args.patch else cmd_report(args)
        except (Exception, MemoryError) as exc:  # noqa: BLE001 - exit 3 with one line, never 1 with a traceback
            return _cannot("report", exc)
    if args.command == "check" and args.model:
        return cmd_rehearse(args)
    if args.command == "check":
        try:
            from .check import cmd_check

            return cmd_check(args)
        except (Exception, MemoryError) as exc:  # noqa: BLE001
            return _cannot("check", exc)
    if args.command == "verify":
        from .output import cmd_verify

        return cmd_verify(args)
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(args)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
