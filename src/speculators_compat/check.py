"""``speculators-compat check``: will extraction work with the installed vLLM? No model, no GPU.

Imports vLLM and speculators' generator and worker modules (every patch's gates and probes run),
binds every declared call (``Patch.calls`` and speculators' own ``SPECULATORS_CALLS``) to the
installed signatures and probes the remaining names (``NAME_SITES``); a moved or re-signed name
is drift naming its call site. Exit codes: 0 supported · 1 works but untested · 2 drift ·
3 cannot check (one line, never a traceback). ``--model PATH`` rehearses a model (test bed).
Details: docs/MODULES.md.
"""

from __future__ import annotations

import inspect
import json
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from xml.sax.saxutils import escape, quoteattr

from .layers import ADAPTERS, adapter_for
from .patches._signatures import EXECUTOR as _EXEC, GENERATOR, WORKER, absent, first_binding, for_speculators, import_attr, require_params
from .patches.speculators_script import CONFIG_GENERATOR, PREPROCESSING
from .registry import Call

EXIT_SUPPORTED, EXIT_UNTESTED, EXIT_DRIFT, EXIT_CANNOT = 0, 1, 2, 3


@dataclass
class Finding:
    kind: str  # call-site | patch | import | versions | platform
    name: str  # the call site or patch id
    status: str  # ok | drift | skipped | error | adjusted (works: a patch changes a setting)
    detail: str = ""


def _attr(module: str, attr: str) -> Callable[[], str | None]:
    def probe():
        try:
            import_attr(module, attr)
        except (ImportError, AttributeError) as exc:
            return f"expected {module}.{attr}; not found ({type(exc).__name__}: {exc})"
        return None

    return probe


def _params(module: str, attr: str, names: tuple[str, ...]) -> Callable[[], str | None]:
    def probe():
        try:
            obj = import_attr(module, attr)
        except (ImportError, AttributeError) as exc:
            return f"expected {module}.{attr}; not found ({exc})"
        return require_params(obj, names, f"{module}.{attr}")

    return probe


def _any_of(*probes: Callable[[], str | None]) -> Callable[[], str | None]:
    def probe():
        problems = [p() for p in probes]
        if all(problems):
            return " / ".join(problems)
        return None

    return probe


def _source_contains(module: str, attr: str, needle: str, what: str) -> Callable[[], str | None]:
    def probe():
        try:
            obj = import_attr(module, attr)
            src = inspect.getsource(obj)
        except (ImportError, AttributeError, OSError, TypeError) as exc:
            return f"expected {module}.{attr}; not readable ({exc})"
        if needle not in src:
            return f"expected {module}.{attr} to {what} ({needle!r}); not found in its source"
        return None

    return probe


def _decoder_layers() -> Callable[[], str | None]:
    known = {
        "vllm.model_executor.models.llama": "LlamaDecoderLayer",
        "vllm.model_executor.models.qwen2": "Qwen2DecoderLayer",
        "vllm.model_executor.models.qwen3": "Qwen3DecoderLayer",
        "vllm.model_executor.models.qwen3_moe": "Qwen3MoeDecoderLayer",
        "vllm.model_executor.models.deepseek_v2": "DeepseekV2DecoderLayer",
        "vllm.model_executor.models.gpt_oss": "TransformerBlock",
        "vllm.model_executor.models.gemma3": "Gemma3DecoderLayer",
    }

    def probe():
        problems = []
        for module, name in known.items():
            assert name in ADAPTERS
            try:
                cls = import_attr(module, name)
            except (ImportError, AttributeError) as exc:
                problems.append(f"{module}.{name}: not importable ({type(exc).__name__}: {exc})")
                continue
            try:
                adapter_for(cls)
            except Exception as exc:  # noqa: BLE001
                problems.append(str(exc))
        return "; ".join(problems) or None

    return probe


# vLLM internals speculators' generator (G) and worker extension (W) use that are not calls the
# shim's patches declare: names and keywords only (the config classes: their calls are adapted
# by the config patches, which add or drop arguments per release).
NAME_SITES: list[tuple[str, Callable[[], str | None]]] = [
    ("G: vllm.config.ModelConfig(model, tokenizer, trust_remote_code, dtype, max_model_len, enforce_eager)",
     _params("vllm.config", "ModelConfig", ("model", "tokenizer", "trust_remote_code", "dtype", "max_model_len", "enforce_eager"))),
    ("G: vllm.config.CacheConfig(block_size, gpu_memory_utilization)",
     _params("vllm.config", "CacheConfig", ("block_size", "gpu_memory_utilization"))),
    ("G: vllm.config.ParallelConfig(tensor_parallel_size, worker_extension_cls)",
     _params("vllm.config", "ParallelConfig", ("tensor_parallel_size", "worker_extension_cls"))),
    ("G: vllm.config.SchedulerConfig(max_num_seqs, max_model_len, max_num_batched_tokens)",
     _params("vllm.config", "SchedulerConfig", ("max_num_seqs", "max_model_len", "max_num_batched_tokens"))),
    ("G: vllm.config.VllmConfig(model_config, cache_config, parallel_config, scheduler_config, device_config, load_config)",
     _params("vllm.config", "VllmConfig", ("model_config", "cache_config", "parallel_config", "scheduler_config", "device_config", "load_config"))),
    ("G: vllm.config.DeviceConfig", _attr("vllm.config", "DeviceConfig")),
    ("G: vllm.config.LoadConfig", _attr("vllm.config", "LoadConfig")),
    ("G: RequestStatus.FINISHED_ABORTED",
     lambda: None if hasattr(import_attr("vllm.v1.request", "RequestStatus"), "FINISHED_ABORTED")
     else "expected RequestStatus.FINISHED_ABORTED; not found"),
    ("W: vllm.sequence.IntermediateTensors", _attr("vllm.sequence", "IntermediateTensors")),
    ("W: plugins load before worker_extension_cls is resolved (vllm.general_plugins reaches workers)",
     _any_of(
         _source_contains("vllm.v1.worker.worker_base", "WorkerWrapperBase.init_worker", "load_general_plugins", "call load_general_plugins"),
         _source_contains("vllm.worker.worker_base", "WorkerWrapperBase.init_worker", "load_general_plugins", "call load_general_plugins"),
     )),
    ("W: decoder-layer adapters for the known architectures", _decoder_layers()),
]

_KCU = "vllm.v1.core.kv_cache_utils"

# Calls speculators' code makes that no shim patch rewrites (G: generator, W: worker extension).
# The patches' own calls come from their ``calls=`` declarations (registry.Call).
SPECULATORS_CALLS: list[tuple[str, Call | tuple[Call, ...]]] = [
    ("G", Call(_KCU, "unify_hybrid_kv_cache_specs", args=("kv_cache_spec",))),
    ("G", Call(_KCU, "_get_kv_cache_groups_uniform_spec", args=("kv_cache_spec",))),
    ("G", Call(_KCU, "get_request_block_hasher", args=("block_size", "caching_hash_fn"), speculators=">=0.4")),
    ("G", Call(_KCU, "init_none_hash", args=("caching_hash_fn",), speculators=">=0.4")),
    ("G", Call("vllm.utils.hashing", "get_hash_fn_by_name", args=("hash_fn_name",), speculators=">=0.4")),
    ("G", Call("vllm.sampling_params", "SamplingParams", kwargs=("max_tokens", "temperature"))),
    ("G", Call("vllm.v1.structured_output", "StructuredOutputManager", kwargs=("vllm_config",))),
    ("G", Call(_EXEC, "MultiprocExecutor", kwargs=("vllm_config",))),
    ("G", Call(_EXEC, "MultiprocExecutor.collective_rpc", args=("method",))),
    ("G", Call(_EXEC, "MultiprocExecutor.collective_rpc", args=("method",), kwargs=("args",))),
    ("G", Call(_EXEC, "MultiprocExecutor.collective_rpc", args=("method",), kwargs=("unique_reply_rank",))),
    ("G", Call(_EXEC, "MultiprocExecutor.initialize_from_config", args=("kv_cache_configs",))),
    ("G", Call(_EXEC, "MultiprocExecutor.shutdown")),
    ("W", Call("vllm.distributed", "get_pp_group")),
    ("W", Call("vllm.distributed", "get_tp_group")),
    ("W", Call("vllm.model_executor.models.interfaces", "supports_eagle3", args=("model",), speculators="==0.3.0")),
]


def call_findings(origin: str, spec, speculators_version: str | None) -> Finding | None:
    """Bind one declared call (or the first binding of its alternative forms) to the installed
    signature; None where the call does not apply to this speculators release."""
    forms = tuple(f for f in (spec if isinstance(spec, tuple) else (spec,)) if for_speculators(f, speculators_version))
    if not forms:
        return None
    head = forms[0]
    name = f"{origin}: {head.module}.{head.describe()}" + (f" (or {len(forms) - 1} other form(s))" if len(forms) > 1 else "")
    try:
        form, problem = first_binding(forms)
    except Exception as exc:  # noqa: BLE001 - a probe never crashes check
        form, problem = None, f"binding raised {type(exc).__name__}: {exc}"
    if form is not None:
        detail = "absent here (optional: called only where it exists)" if absent(form) else ""
        return Finding("call-site", f"{origin}: {head.module}.{form.describe()}", "ok", detail)
    return Finding("call-site", name, "drift", problem or "no form binds")


def declared_calls(reg, statuses: list[dict]) -> list[tuple[str, object]]:
    """(origin, Call | forms) of speculators' own calls and of the ``calls`` of every patch that
    applied or failed (probe, build, strict refusal or lost: its calls say what moved)."""
    out: list[tuple[str, object]] = [(origin, spec) for origin, spec in SPECULATORS_CALLS]
    bound = {r["id"] for r in statuses if r["status"] in ("applied", "failed")}
    chosen = {r["id"] for r in statuses if not r["reason"].startswith(_RANGED_OUT[:2])}
    versions = reg.version_strings()
    for pid, patch in reg.patches.items():
        gated_in = pid in chosen and pid in reg.matrix.patches and reg.matrix.patches[pid].gate(versions) is None
        if pid in bound or (patch.script_target and gated_in):
            out.extend((f"patch {pid}", spec) for spec in patch.calls)
    return out


def _shipped_matrix_path():
    from pathlib import Path

    from . import matrix as matrix_module

    packaged = Path(matrix_module.__file__).with_name("compat_matrix.yaml")
    return packaged if packaged.is_file() else Path(matrix_module.__file__).resolve().parents[2] / "compat_matrix.yaml"


_RANGED_OUT = ("excluded by SPECULATORS_COMPAT_PATCHES", "not selected by SPECULATORS_COMPAT_PATCHES", "not needed: ")


def ranged_out_findings(reg, statuses: list[dict], versions: dict) -> list[Finding]:
    """A patch that the user's matrix or SPECULATORS_COMPAT_PATCHES left out, although the shipped
    matrix has it in range and its probe of the real objects says it would apply: the generator
    runs without a fix it needs. Reported as drift, never as supported."""
    from pathlib import Path

    from .matrix import load_matrix
    from .registry import MISSING, NotNeeded, _resolve_parent

    skipped = [r for r in statuses if r["status"] == "skipped" and r["reason"].startswith(_RANGED_OUT)]
    if not skipped:
        return []
    shipped = load_matrix(_shipped_matrix_path(), known_ids=set(reg.patches))
    user_matrix = Path(reg.matrix.path).resolve() != Path(shipped.path).resolve()
    if shipped.not_applicable_reason(versions.get("speculators")):
        return []
    out = []
    for rec in skipped:
        pid, reason = rec["id"], rec["reason"]
        by_matrix = reason.startswith("not needed: ")
        if by_matrix and not user_matrix:
            continue
        if by_matrix and "outside" not in reason and "not installed" not in reason:
            continue  # the probe said not needed, not the matrix
        if pid not in shipped.patches or shipped.patches[pid].gate(versions) is not None:
            continue
        patch = reg.patches[pid]
        try:
            parent, attribute = _resolve_parent(*patch.owner)
            current = getattr(parent, attribute, MISSING)
        except (KeyError, AttributeError):
            continue  # its target is not imported here: nothing would apply it either
        try:
            problem = patch.probe(current)
        except Exception as exc:  # noqa: BLE001
            problem = f"probe raised {type(exc).__name__}: {exc}"
        if isinstance(problem, NotNeeded):
            continue
        who = f"the matrix {reg.matrix.path}" if by_matrix else "SPECULATORS_COMPAT_PATCHES"
        verdict = f"its probe fails too: {problem}" if problem else "its probe says it applies here"
        out.append(
            Finding(
                "patch",
                pid,
                "drift",
                f"left out by {who} ({reason}), but the shipped matrix has it in range for these versions and "
                f"{verdict}; the generator runs without: {shipped.patches[pid].why}",
            )
        )
    return out


def _import_finding(module: str, exc: BaseException) -> Finding:
    """speculators' generator/worker module failed to import.  When the failing import is a vLLM
    name (``from vllm.x import y`` / ``import vllm.x`` — the commonest way a release moves an
    internal), that is drift at an import site, not an unusable environment: the call-site probes
    still run and name it.  Anything else (transformers, torch, a syntax error) cannot be checked."""
    detail = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"
    missing = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
    if missing and missing.split(".")[0] == "vllm":
        return Finding("import", module, "drift", f"expected {module} to import from vLLM; {detail}")
    return Finding("import", module, "error", detail)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else f"{type(exc).__name__} (no message)"


def run_check() -> tuple[int, dict]:
    """The verdict; an internal error of check itself (MemoryError included) is exit 3, never 1."""
    try:
        return _run_check()
    except (Exception, MemoryError) as exc:  # noqa: BLE001 - "cannot check" with one line
        line = _one_line(exc)
        finding = Finding("import", "speculators-compat check", "error", f"cannot check: {line}")
        return EXIT_CANNOT, {"versions": {}, "findings": [finding], "internal_error": line}


def _run_check() -> tuple[int, dict]:
    import speculators_compat
    from .matrix import MatrixError

    started = time.perf_counter()
    findings: list[Finding] = []
    reg = speculators_compat.get_registry()
    versions = reg.version_strings()
    out = {"versions": versions, "findings": findings}
    if not versions.get("vllm"):
        findings.append(Finding("import", "vllm", "error", "vLLM is not installed"))
    if not versions.get("speculators"):
        findings.append(Finding("import", "speculators", "error", "speculators is not installed"))
    if findings:
        return EXIT_CANNOT, out
    try:
        matrix = reg.matrix
    except MatrixError as exc:
        findings.append(Finding("import", "compat_matrix", "error", str(exc)))
        return EXIT_CANNOT, out
    na = matrix.not_applicable_reason(versions["speculators"])
    if na:
        findings.append(Finding("versions", "speculators", "error", f"not applicable: {na}"))
        return EXIT_CANNOT, out
    try:
        __import__("vllm")
    except Exception as exc:  # noqa: BLE001
        findings.append(Finding("import", "vllm", "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"))
        return EXIT_CANNOT, out
    for module in (GENERATOR, WORKER, CONFIG_GENERATOR, PREPROCESSING):
        try:
            __import__(module)
        except Exception as exc:  # noqa: BLE001
            findings.append(_import_finding(module, exc))
    for name, probe in NAME_SITES:
        try:
            problem = probe()
        except Exception as exc:  # noqa: BLE001
            problem = f"probe raised {type(exc).__name__}: {exc}"
        findings.append(Finding("call-site", name, "drift" if problem else "ok", problem or ""))
    reg.retry_failed()  # an earlier failure in this process may be gone
    statuses = speculators_compat.report()
    for origin, spec in declared_calls(reg, statuses):
        finding = call_findings(origin, spec, versions.get("speculators"))
        if finding is not None:
            findings.append(finding)
    for rec in statuses:
        status = rec["status"]
        if status == "failed":
            findings.append(Finding("patch", rec["id"], "drift", f"{rec['target']}: {rec['reason']}"))
        else:
            findings.append(Finding("patch", rec["id"], "ok" if status == "applied" else "skipped", rec["reason"]))
    findings.extend(ranged_out_findings(reg, statuses, versions))
    findings.extend(cpu_attention_findings(statuses))
    platform, rows = reg.tested_rows()
    verified = any(r.status == "verified" for r in rows)
    broken = any(r.status == "broken" for r in rows)
    elsewhere = [r for r in reg.tested_rows(everywhere=True)[1] if r not in rows]
    detail = "; ".join(f"{r.platform}: {r.status} ({r.evidence})" for r in rows) or (
        f"pair not in the tested table for this vLLM build ({platform})"
        + ("; only on " + ", ".join(f"{r.platform} ({r.status})" for r in elsewhere) if elsewhere else "")
    )
    findings.append(Finding("versions", "tested-table", "ok" if verified and not broken else "untested", detail))
    out["seconds"] = time.perf_counter() - started
    return verdict(findings, verified, broken), out


CPU_ATTENTION_CASES = (("bfloat16", 64), ("bfloat16", 128), ("float32", 64), ("float32", 128))


def cpu_attention_findings(statuses: list[dict]) -> list[Finding]:
    """On CPU vLLM 0.12+: for the generator's settings (block size left to the platform,
    speculators' own 16 as the fallback) and common dtypes / head sizes, whether the attention
    kernel vLLM's rule picks runs on this machine (``patches/cpu_attention.py``): ``adjusted``
    where engine-options gives the engine block 16, drift where nothing runs or the patch is off."""
    from .patches.cpu_attention import attention_plan, isa_rule
    from .patches.engine_options import on_cpu

    try:
        if not on_cpu() or isa_rule() is None:
            return []
        import torch
    except Exception as exc:  # noqa: BLE001 - reported as a finding
        return [Finding("platform", "cpu-attention", "error", f"{type(exc).__name__}: {exc}")]
    applied = any(r["id"] == "engine-options" and r["status"] == "applied" for r in statuses)
    out = []
    for dtype_name, head in CPU_ATTENTION_CASES:
        name = f"cpu-attention {dtype_name} head {head}"
        try:
            plan = attention_plan(getattr(torch, dtype_name), head, None)
        except Exception as exc:  # noqa: BLE001 - the installed rule or kernel op moved
            out.append(Finding("platform", name, "drift", f"{type(exc).__name__}: {exc}"))
            continue
        if plan.problem:
            out.append(Finding("platform", name, "drift", plan.problem))
        elif plan.block_size is not None and not applied:
            out.append(Finding("platform", name, "drift", f"{plan}; engine-options is not applied, so the engine "
                                                          "gets the block size whose kernel cannot run here"))
        elif plan.block_size is not None:
            out.append(Finding("platform", name, "adjusted", f"{plan}; engine-options gives the engine block size {plan.block_size}"))
        else:
            out.append(Finding("platform", name, "ok", str(plan)))
    return out


def verdict(findings: list[Finding], verified: bool, broken: bool) -> int:
    """3 if anything could not be checked, 2 on any drift, else 0 (verified pair) or 1."""
    if any(f.status == "error" for f in findings):
        return EXIT_CANNOT
    if any(f.status == "drift" for f in findings):
        return EXIT_DRIFT
    return EXIT_SUPPORTED if verified and not broken else EXIT_UNTESTED


def _junit(out: dict, code: int) -> str:
    cases = []
    for f in out["findings"]:
        body = ""
        if f.status in ("drift", "error"):
            body = f'<failure message={quoteattr(f.detail.splitlines()[0] if f.detail else f.status)}>{escape(f.detail)}</failure>'
        elif f.status in ("skipped", "untested"):
            body = f"<skipped message={quoteattr(f.detail[:200])}/>"
        cases.append(f"<testcase classname={quoteattr('speculators_compat.check.' + f.kind)} name={quoteattr(f.name)}>{body}</testcase>")
    failures = sum(f.status in ("drift", "error") for f in out["findings"])
    return (
        '<?xml version="1.0" encoding="utf-8"?>\n'
        f'<testsuite name="speculators-compat check" tests="{len(cases)}" failures="{failures}" '
        f'errors="0" time="{out.get("seconds", 0):.3f}">\n' + "\n".join(cases) + "\n</testsuite>\n"
    )


EXIT_WORDS = {0: "supported", 1: "works, untested", 2: "DRIFT", 3: "cannot check"}


def _run_with_stdout_on_stderr():
    """vLLM and speculators log to stdout while importing: keep stdout for our report only."""
    import os
    import sys

    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    real_stdout, sys.stdout = sys.stdout, sys.stderr
    try:
        return run_check()
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
        sys.stdout = real_stdout


def cmd_check(args) -> int:
    """Exit 0-3 as documented; anything that goes wrong in check itself (an unwritable --junit
    path, MemoryError, a bad SPECULATORS_COMPAT_PATCHES) is one line on stderr and exit 3."""
    import sys

    try:
        return _cmd_check(args)
    except (Exception, MemoryError) as exc:  # noqa: BLE001
        print(f"speculators-compat check: cannot check: {_one_line(exc)}", file=sys.stderr)
        return EXIT_CANNOT


def _cmd_check(args) -> int:
    import sys

    code, out = _run_with_stdout_on_stderr()
    serial = {**out, "findings": [asdict(f) for f in out["findings"]], "exit_code": code, "verdict": EXIT_WORDS[code]}
    if args.junit:
        try:
            with open(args.junit, "w") as fh:
                fh.write(_junit(out, code))
        except OSError as exc:
            print(
                f"speculators-compat check: cannot write --junit {args.junit}: {exc.strerror or exc} "
                f"(the verdict was: {EXIT_WORDS[code]}, exit {code})",
                file=sys.stderr,
            )
            return EXIT_CANNOT
    if args.json:
        print(json.dumps(serial, indent=2))
        return code
    if out.get("internal_error"):
        print(f"speculators-compat check: cannot check: {out['internal_error']}", file=sys.stderr)
        return code
    v = out["versions"]
    print(f"speculators {v.get('speculators')} · vLLM {v.get('vllm')} · transformers {v.get('transformers')} · torch {v.get('torch')}")
    for f in out["findings"]:
        if f.status == "ok" and not args.verbose:
            continue
        mark = {"ok": "ok", "drift": "DRIFT", "error": "ERROR", "skipped": "skip", "untested": "untested",
                "adjusted": "adjusted"}[f.status]
        detail = f.detail if args.verbose or "\n" not in f.detail else f.detail.splitlines()[0] + "  (-v: traceback)"
        print(f"  [{mark:<8}] {f.kind:<9} {f.name}" + (f"\n             {detail}" if f.detail and f.status != "ok" else ""))
    ok = sum(f.status == "ok" for f in out["findings"])
    print(f"{ok} checks ok; verdict: {EXIT_WORDS[code]} (exit {code})")
    return code
