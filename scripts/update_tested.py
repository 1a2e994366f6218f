#!/usr/bin/env python3
"""Generate the ``tested:`` table of compat_matrix.yaml from real end-to-end results.

Reads every result JSON written by ``speculators_compat_testbed.e2e_runner`` under
``benchmarks/results/e2e/`` and ``benchmarks/results/gpu/`` (recursively; files that are not e2e
results, e.g. throughput benchmarks, are skipped). Cells are keyed by what the JSON says
(installed versions, arch, platform, patched/unpatched), not by file name.

A result COUNTS only when all of these hold (nothing is re-judged against today's tolerances:
the runner's own verdict is taken as recorded):

- it carries ``provenance`` (``speculators_compat_testbed.provenance``) with a commit, a src
  tree, and ``dirty: false``;
- it finished (no ``error``) with every case present (mixed, chunked, truncated, repeat), one
  output per input sequence and every output as long as expected (``lengths_out`` equals
  ``lengths_expected``, else ``min(len, max_model_len - 1)`` of ``lengths_in``);
- the repeat call was bit-identical, the worker reports capturing with the shim's worker
  patches applied, and the runner's own ``passed`` is true.

A result whose run broke (``error``, a failed case) counts as evidence of breakage when its
provenance is clean. One row per (speculators, vLLM release, platform):

- ``verified``: every arch of ``STATUS_ARCHS`` has a counting, passing cell whose ``src_tree``
  equals ``git rev-parse HEAD:src`` (the code as committed now);
- ``broken``: a clean cell at HEAD's src tree failed (evidence: its first error, one line);
- ``stale``: results exist, but none decides at HEAD (an older src tree - its commit is given -,
  no provenance, a dirty tree, or an arch missing at HEAD); ``check`` treats it as untested;
- ``untested``: only unpatched cells were run for that pair.

Cells run with ``--overrides``, with ``--tensor-parallel-size`` other than 1, or of an arch
outside ``STATUS_ARCHS`` are exploratory: they never decide the status, but are named in the
evidence. vLLM builds are normalised to their release (``0.11.0.post2`` / ``0.16.0+cpu`` ->
``0.11.0`` / ``0.16.0``). When a cell was run more than once, the newest ``provenance.date_utc``
wins (results without provenance rank oldest). Dates come from provenance, never from file
times, so ``--check`` gives the same answer on a fresh clone.

Only the lines from the top-level ``tested:`` key to the next top-level key (or the end of the
file) are rewritten; the rest of the file is kept byte for byte. The new file is validated
(``load_matrix`` with the code's patch ids, when importable) before it is written.

Also writes ``benchmarks/results/e2e/SUMMARY.md`` (pair x arch table).

Usage::

    python3 scripts/update_tested.py [--check] [--no-summary]

``--check``: exit 1 if compat_matrix.yaml or SUMMARY.md would change (nothing written); it runs
in ``make test``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
MATRIX = ROOT / "compat_matrix.yaml"
# the archs that decide a pair's status (what `make test` runs); others are exploratory
STATUS_ARCHS = ("llama", "qwen3")
RESULT_DIRS = [ROOT / "benchmarks" / "results" / "e2e", ROOT / "benchmarks" / "results" / "gpu"]
SUMMARY = ROOT / "benchmarks" / "results" / "e2e" / "SUMMARY.md"
ARCH_ORDER = ["llama", "qwen3"]
CASES = ("mixed", "chunked", "truncated")
E2E_COMMAND = (
    "make sweep   # every CPU pair of noxfile.PAIRS x llama,qwen3 at HEAD, then this script; one cell:\n"
    "PYTHONPATH=$PWD/src:$PWD/testbed VLLM_CPU_KVCACHE_SPACE=1 $PY -m speculators_compat_testbed.e2e_runner --arch ARCH "
    "--out benchmarks/results/e2e/spec-S_vllm-V_ARCH.json"
)
UNPATCHED_NOTE = (
    "Unpatched cells are run with `SPECULATORS_COMPAT_DISABLE=1` in the environment as well as"
    " `--unpatched`: `python -m speculators_compat_testbed.e2e_runner` imports (and so activates)"
    " the package before the runner sets the variable, so `--unpatched` alone leaves the main"
    " process patched and only the workers unpatched."
)


# --------------------------------------------------------------------------- reading results


def release(version: str | None) -> str | None:
    """The release part of a version: 0.11.0.post2 -> 0.11.0, 0.16.0+cpu -> 0.16.0, 0.17.0rc1 -> 0.17.0."""
    if version is None:
        return None
    m = re.match(r"^\s*v?(\d+(?:\.\d+)*)", str(version))
    if not m:
        return str(version)
    # a 4th numeric component is part of the release (speculators 0.4.0.1); .postN/.devN/rcN/+local are not
    return m.group(1)


def _vkey(version: str) -> tuple:
    """Sort key: the package's own version parser (speculators_compat.versions.normalize); a
    name that is no version ("none") sorts after every version."""
    from packaging.version import InvalidVersion  # noqa: PLC0415

    if str(ROOT / "src") not in sys.path:
        sys.path.insert(0, str(ROOT / "src"))
        sys.path.insert(1, str(ROOT / "testbed"))
    from speculators_compat.versions import normalize  # noqa: PLC0415

    try:
        return (0, normalize(version or "0"), "")
    except InvalidVersion:
        return (1, None, str(version))


def _one_line(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def head_src_tree(root: Path = ROOT) -> str | None:
    """``git rev-parse HEAD:src``: the tree of src/ as committed now (None outside a git checkout)."""
    try:
        r = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD:src"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else None


class Cell:
    def __init__(self, path: Path, data: dict):
        self.path = path
        self.data = data
        versions = data.get("versions") or {}
        self.speculators = str(versions.get("speculators"))
        self.vllm_build = str(versions.get("vllm"))
        self.vllm = release(versions.get("vllm"))
        self.platform = str(data.get("platform") or "cpu")
        self.arch = str(data.get("arch"))
        self.unpatched = bool(data.get("unpatched"))
        self.error = data.get("error")
        prov = data.get("provenance")
        self.prov = prov if isinstance(prov, dict) else {}
        self.variant = (
            bool(data.get("overrides"))
            or (data.get("tensor_parallel_size") or 1) != 1
            or data.get("arch") not in STATUS_ARCHS
            or self.variant_name != self.arch  # a named variant file (e.g. ..._llama_v1runner.json)
        )
        self.flaws = self._flaws()  # why the run does not count as evidence at all
        self.failures = self._failures()  # why its own verdict is a failure
        self.passed = not self.flaws and not self.failures

    # -- what the JSON holds -----------------------------------------------------------------

    @property
    def commit(self) -> str | None:
        return self.prov.get("commit")

    @property
    def src_tree(self) -> str | None:
        return self.prov.get("src_tree")

    @property
    def date(self) -> str:
        return str(self.prov.get("date_utc") or "")

    def machine(self) -> str:
        """Where the cell ran, in a few words: the GPU, or the CPU and whether it has AMX (the
        flag that picks vLLM's amx attention kernel); '' for results from before provenance said."""
        m = self.prov.get("machine")
        if not isinstance(m, dict):
            return ""
        if m.get("gpu"):
            return str(m["gpu"])
        flags = str(m.get("cpu_flags") or "").split()
        isa = "AMX" if "amx_tile" in flags else "AVX-512, no AMX" if "avx512f" in flags else "no AVX-512"
        return f"CPU with {isa}" if isa == "AMX" else f"CPU ({isa})"

    def _flaws(self) -> list[str]:
        """Reasons the result is no evidence either way (provenance, completeness)."""
        if not self.prov:
            return ["no provenance"]
        out = []
        if not self.commit or not self.src_tree:
            out.append("provenance without commit/src tree (" + str(self.prov.get("reason") or "not a git checkout") + ")")
        if self.prov.get("dirty") is not False:
            out.append("run from a dirty tree" if self.prov.get("dirty") else "dirty state unknown")
        if self.error or self.unpatched:
            return out  # an engine error is a result; unpatched runs are expected to fail
        cases = self.data.get("cases") or {}
        missing = [c for c in (*CASES, "repeat") if not isinstance(cases.get(c), dict)]
        if missing:
            out.append("cases missing: " + ",".join(missing))
        mml = self.data.get("max_model_len") or 2048
        for name in CASES:
            case = cases.get(name)
            if not isinstance(case, dict):
                continue
            lin, lout = case.get("lengths_in"), case.get("lengths_out")
            if not isinstance(lin, list) or not isinstance(lout, list):
                out.append(f"{name}: lengths not recorded")
                continue
            expected = case.get("lengths_expected") or [min(int(n), int(mml) - 1) for n in lin]
            if len(lout) != len(lin) or list(lout) != list(expected):
                out.append(f"{name}: {len(lout)} outputs for {len(lin)} inputs, lengths {lout} vs expected {expected}")
        return out

    def _row_failures(self) -> list[str]:
        """The captured rows' part of the run's verdict: each case that failed, a repeat that differed."""
        out = []
        cases = self.data.get("cases") or {}
        for name in CASES:
            case = cases.get(name)
            if isinstance(case, dict) and not case.get("passed"):
                why = []
                if not case.get("shapes_ok", True):
                    why.append("shapes/ids wrong")
                if isinstance(case.get("max_error"), (int, float)):
                    why.append(f"max rel err {case['max_error']:.1e} (tol {case.get('tolerance', float('nan')):.0e})")
                w = case.get("worst_row")
                if isinstance(w, dict) and isinstance(w.get("error"), (int, float)):
                    why.append(f"worst row {w['error']:.1e} (seq {w.get('sequence')} layer {w.get('layer')} row {w.get('row')})")
                out.append(f"{name}: {', '.join(why) or 'failed'}")
        rep = cases.get("repeat")
        if isinstance(rep, dict) and not rep.get("identical"):
            out.append("repeat: not bit-identical")
        return out

    def _failures(self) -> list[str]:
        """The run's own verdict (as recorded; never re-judged)."""
        if self.error:
            msg = str(self.error.get("message") or "").strip()
            first = msg.splitlines()[0] if msg else ""
            return [f"{self.error.get('type')}: {first}" if first else str(self.error.get("type"))]
        if self.unpatched:
            return [] if self.data.get("passed") else ["did not pass"]
        out = self._row_failures()
        worker = self.data.get("worker")
        wp = {p.get("id"): p.get("status") for p in (worker or {}).get("patches") or [] if isinstance(p, dict)} \
            if isinstance(worker, dict) else {}
        capture = {k: v for k, v in wp.items() if str(k).startswith("worker-capture")}
        if not isinstance(worker, dict) or worker.get("error") or not worker.get("captures") \
                or not capture or any(v != "applied" for v in capture.values()):
            out.append(f"worker patches not applied ({worker.get('error') if isinstance(worker, dict) else worker}"
                       f"; {capture or 'no worker-capture patches'})")
        records = list(self.data.get("patches") or [])
        if isinstance(worker, dict):
            records += list(worker.get("patches") or [])
        failed = sorted({str(p.get("id")) for p in records if isinstance(p, dict) and p.get("status") == "failed"})
        if failed and not self.data.get("unpatched"):
            out.append(f"patch(es) failed (probe, or applied then lost): {', '.join(failed)}")
        if self.data.get("passed") is not True:
            out.append("runner verdict: passed is not true")
        return out

    def at(self, tree: str | None) -> bool:
        """Clean evidence produced by the src tree ``tree``."""
        return not self.flaws and tree is not None and self.src_tree == tree

    @property
    def pair(self) -> tuple[str, str, str]:
        return (self.speculators, self.vllm, self.platform)

    @property
    def dtype(self) -> str:
        return str(self.data.get("dtype") or "?")

    @property
    def max_error(self) -> float | None:
        errs = [
            c.get("max_error")
            for c in (self.data.get("cases") or {}).values()
            if isinstance(c, dict) and isinstance(c.get("max_error"), (int, float))
        ]
        return max(errs) if errs else None

    @property
    def worst_row(self) -> float | None:
        errs = [
            c["worst_row"]["error"]
            for c in (self.data.get("cases") or {}).values()
            if isinstance(c, dict) and isinstance(c.get("worst_row"), dict)
            and isinstance(c["worst_row"].get("error"), (int, float))
        ]
        return max(errs) if errs else None

    @property
    def variant_name(self) -> str:
        """The cell's name from its file (``e2e_spec-0.4.0.1_deepseek_v3_mla_moe.json`` ->
        ``deepseek_v3_mla_moe``), else the arch."""
        stem = self.path.stem
        prefix = f"e2e_spec-{self.speculators}_"
        return stem[len(prefix):] if stem.startswith(prefix) and len(stem) > len(prefix) else self.arch

    def error_line(self, limit: int = 160) -> str:
        """One line: how this cell failed (error type + message, or which check did not hold)."""
        if self.passed:
            return "passed"
        if self.error:
            return _one_line(self.failures[0], limit)
        ref = "vLLM's own forward" if str(self.data.get("reference")).startswith("vllm") else "HF"
        bad = self.failures or self.flaws
        settled = self.data.get("settled") or {}
        cases = settled.get("cases") or {}
        if self.failures and settled.get("settled") and cases and all(c["identical"] == c["rows"] for c in cases.values()):
            rows = sum(c["rows"] for c in cases.values())  # --settle: the second reference agreed in every row
            return _one_line(f"differs from {ref}; every one of {rows:,} rows bit-identical to vLLM's own "
                             "forward scheduled as the generator (engine numerics, settled)", limit)
        rows_wrong = not self.unpatched and self._row_failures()
        return _one_line(f"mismatch vs {ref} (" + "; ".join(bad) + ")" if rows_wrong else "; ".join(bad), limit)

    def error_type(self) -> str:
        if self.error:
            return str(self.error.get("type"))
        return "passed" if self.passed else "mismatch"

    def short(self) -> str:
        """PASS/FAIL as the runner recorded it, with the measured figures."""
        verdict = "FAIL" if self.failures else "pass"
        figs = []
        if self.max_error is not None:
            figs.append(f"err {self.max_error:.1e}")
        if self.worst_row is not None:
            figs.append(f"worst row {self.worst_row:.1e}")
        return f"{self.arch} {verdict}" + (f" ({', '.join(figs)})" if figs else "")


def load_cells(dirs=RESULT_DIRS) -> list[Cell]:
    cells = []
    for d in dirs:
        if not d.is_dir():
            continue
        for path in sorted(d.rglob("*.json")):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                print(f"skip {path.relative_to(ROOT)}: {exc}", file=sys.stderr)
                continue
            if not isinstance(data, dict) or not {"arch", "versions", "unpatched"} <= data.keys():
                continue  # not an e2e cell (throughput etc.)
            cell = Cell(path, data)
            if cell.speculators in ("None", "") or cell.vllm in (None, "None"):
                print(f"skip {path.relative_to(ROOT)}: versions missing", file=sys.stderr)
                continue
            cells.append(cell)
    return cells


def group(cells: list[Cell]) -> dict:
    """{pair: {"patched": {arch: Cell}, "unpatched": {arch: Cell}, "variants": {name: Cell}}}, the
    newest run (provenance date; none = oldest; then file name) per cell."""
    out: dict = {}
    for c in sorted(cells, key=lambda c: (c.date, str(c.path))):
        slot = out.setdefault(c.pair, {"patched": {}, "unpatched": {}, "variants": {}})
        # variants are keyed by their file's cell name (one arch may have several, e.g. MLA with/without MoE)
        key = c.variant_name if c.variant else c.arch
        slot["variants" if c.variant else "unpatched" if c.unpatched else "patched"][key] = c
    return out


def _arch_sort(archs):
    return sorted(archs, key=lambda a: (ARCH_ORDER.index(a) if a in ARCH_ORDER else len(ARCH_ORDER), a))


def _pair_sort(pair):
    s, v, p = pair
    return (_vkey(s), _vkey(v), p)


# --------------------------------------------------------------------------- rows


def _commits(cells) -> str:
    commits = sorted({(c.commit or "")[:10] for c in cells if c.commit})
    return ",".join(commits) if commits else "unknown"


def rows_from(grouped: dict, head_tree: str | None) -> list[dict]:
    rows = []
    for pair in sorted(grouped, key=_pair_sort):
        s, v, platform = pair
        patched, unpatched = grouped[pair]["patched"], grouped[pair]["unpatched"]
        variants = grouped[pair]["variants"]
        everything = [*patched.values(), *unpatched.values(), *variants.values()]
        date = max((c.date[:10] for c in everything if c.date), default="")
        unp = ""
        if unpatched:
            u = unpatched[_arch_sort(unpatched)[0]]
            unp = f"unpatched: {u.error_line(110)}"
        current = {a: c for a, c in patched.items() if c.at(head_tree)}
        commit = ""
        if not patched:
            status, evidence = "untested", ("only unpatched runs; " + unp) if unpatched else ""
        elif any(c.failures for c in current.values()):
            status = "broken"
            f = next(current[a] for a in _arch_sort(current) if current[a].failures)
            ok = [a for a in _arch_sort(current) if current[a].passed]
            evidence = f"e2e {f.arch} failed at HEAD's src: {f.error_line(200)}"
            if ok:
                evidence += f"; passed: {','.join(ok)}"
            commit = _commits([f])
        elif all(a in current and current[a].passed for a in STATUS_ARCHS):
            status = "verified"
            archs = _arch_sort(current)
            errs = [current[a].max_error for a in archs if current[a].max_error is not None]
            rows_ = [current[a].worst_row for a in archs if current[a].worst_row is not None]
            dtypes = sorted({current[a].dtype for a in archs})
            evidence = f"e2e {','.join(archs)} vs HF at HEAD's src"
            if errs:
                evidence += f" max rel err {max(errs):.1e}"
            if rows_:
                evidence += f", worst row {max(rows_):.1e}"
            evidence += f" ({','.join(dtypes)})"
            machines = sorted({m for m in (current[a].machine() for a in archs) if m})
            if machines:
                evidence += f" on {' + '.join(machines)}"
            if unp:
                evidence += "; " + unp
            commit = _commits(current.values())
        else:
            status = "stale"
            old = [patched[a] for a in _arch_sort(patched)]
            why = sorted({"; ".join(c.flaws) if c.flaws else
                          ("src changed since" if not c.at(head_tree) else "") for c in old} - {""})
            missing = [a for a in STATUS_ARCHS if a not in current]
            evidence = (f"not re-run at HEAD's src ({', '.join(missing)} missing); earlier results: "
                        + ", ".join(c.short() for c in old) + f" [{'; '.join(why)}]")
            if unp:
                evidence += "; " + unp
            commit = _commits(old)
        cur_variants = {a: c for a, c in variants.items() if c.at(head_tree)}
        ok_variants = [
            f"{a} {c.max_error:.1e}" if c.max_error is not None else a
            for a, c in sorted(cur_variants.items()) if c.passed
        ]
        if ok_variants:
            evidence += f"; variants passed at HEAD: {', '.join(ok_variants)}"
        for a, c in sorted(cur_variants.items()):
            if not c.passed:
                evidence += f"; variant {a} (exploratory, not counted) failed: {c.error_line(160)}"
        old_variants = sorted(a for a in variants if a not in cur_variants)
        if old_variants:
            evidence += f"; earlier variants (stale): {', '.join(old_variants)}"
        if not patched and not unpatched:
            status, evidence = "untested", evidence.lstrip("; ")
        rows.append({"speculators": s, "vllm": v, "status": status, "platform": platform,
                     "evidence": evidence, "date": date, "commit": commit})
    return rows


def _q(value: str) -> str:
    # a JSON string is a valid YAML double-quoted scalar (ASCII-escaped)
    return json.dumps(str(value), ensure_ascii=True)


def render_tested(rows: list[dict]) -> str:
    if not rows:
        return "tested: []\n"
    lines = [
        "tested:",
        "  # generated by scripts/update_tested.py from benchmarks/results/{e2e,gpu}/*.json — do not edit by hand",
    ]
    for r in rows:
        lines.append(
            "  - {"
            + ", ".join(f"{k}: {_q(r[k])}" for k in ("speculators", "vllm", "status", "platform", "evidence", "date",
                                                     "commit"))
            + "}"
        )
    return "\n".join(lines) + "\n"


def replace_tested(text: str, tested_block: str) -> str:
    lines = text.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if re.match(r"^tested\s*:", ln)), None)
    if start is None:
        sep = "" if text.endswith("\n") or not text else "\n"
        return text + sep + "\n" + tested_block
    end = len(lines)
    for j in range(start + 1, len(lines)):
        if re.match(r"^[A-Za-z_]", lines[j]):  # next top-level key
            end = j
            break
    # keep blank lines / comments that precede the next top-level key with that key
    while end > start + 1 and end < len(lines) and (not lines[end - 1].strip() or lines[end - 1].startswith("#")):
        end -= 1
    tail = "".join(lines[end:])
    return "".join(lines[:start]) + tested_block + (("\n" + tail) if tail and not tail.startswith("\n") else tail)


def validate(text: str) -> None:
    top = yaml.safe_load(text)
    assert isinstance(top, dict) and "tested" in top, "no tested: section after rewrite"
    try:
        sys.path.insert(0, str(ROOT / "src"))
        sys.path.insert(1, str(ROOT / "testbed"))
        from speculators_compat.matrix import load_matrix  # noqa: PLC0415
        from speculators_compat.patches import all_patches  # noqa: PLC0415
    except Exception as exc:  # noqa: BLE001 - yaml-level check already done
        print(f"note: matrix validation skipped ({type(exc).__name__}: {exc})", file=sys.stderr)
        return
    import tempfile  # noqa: PLC0415

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(text)
        tmp = f.name
    try:
        load_matrix(tmp, known_ids={p.id for p in all_patches()})
    finally:
        Path(tmp).unlink(missing_ok=True)


# --------------------------------------------------------------------------- summary


def render_summary(grouped: dict, rows: list[dict], head_tree: str | None) -> str:
    archs = _arch_sort({a for g in grouped.values() for a in [*g["patched"], *g["unpatched"]]})
    by_pair = {(r["speculators"], r["vllm"], r["platform"]): r for r in rows}
    out = [
        "# End-to-end results: speculators' VllmHiddenStatesGenerator on vLLM, vs HF transformers",
        "",
        "Generated by `scripts/update_tested.py` from the JSON files in this folder"
        " (and `../gpu/`). Each cell: the generator built through speculators' own class on the"
        " installed vLLM, batteries `mixed`/`chunked`/`truncated`/`repeat`, every captured layer compared"
        " with HF transformers on the same weights: the relative Frobenius error per (sequence, layer)"
        " (*err*) and every row's own error (*row*: the worst row; bounds in"
        " `speculators_compat_testbed.reference`). A cell counts when its provenance names the"
        " src tree of HEAD (`git rev-parse HEAD:src`) and a clean tree; older cells are stale"
        " (their commit is given) and count for nothing until re-run (`make sweep`).",
        "",
        "Commands (`$PY` = `python3 scripts/bed.py python --speculators S --vllm V`):",
        "",
        "```",
        E2E_COMMAND,
        "```",
        "",
        "| speculators | vLLM (build) | platform | status | commit | "
        + " | ".join(f"{a} (runner verdict, err, row)" for a in archs)
        + " | unpatched (llama) |",
        "|" + "---|" * (5 + len(archs) + 1),
    ]
    for pair in sorted(grouped, key=_pair_sort):
        g = grouped[pair]
        s, v, platform = pair
        builds = sorted({c.vllm_build for c in [*g["patched"].values(), *g["unpatched"].values()]})
        row = by_pair.get(pair, {})
        cols = [s, f"{v} ({', '.join(builds)})" if builds != [v] else v, platform, row.get("status", ""),
                row.get("commit", "")]
        for a in archs:
            c = g["patched"].get(a)
            if c is None:
                cols.append("not run")
                continue
            cell = ("PASS" if c.passed else "FAIL: " + c.error_line(90).replace("|", "\\|")) if not c.flaws \
                else ("pass" if not c.failures else "fail") + " (not counted: " + "; ".join(c.flaws) + ")"
            if c.max_error is not None:
                cell += f", {c.max_error:.2e}"
            if c.worst_row is not None:
                cell += f", row {c.worst_row:.2e}"
            cell += f" ({c.dtype})" if c.max_error is not None else ""
            if not c.flaws and not c.at(head_tree):
                cell += f" [stale: {(c.commit or '')[:10]}]"
            cols.append(cell)
        u = g["unpatched"].get("llama") or next(iter(g["unpatched"].values()), None)
        if u is None:
            cols.append("not run")
        elif not u.failures:
            cols.append("passed (!)")
        else:
            cols.append(f"{u.error_type()}: " + u.error_line(90).split(": ", 1)[-1].replace("|", "\\|"))
        out.append("| " + " | ".join(cols) + " |")
    out += ["", "Unpatched cells must fail: they record how speculators' generator breaks without the shim.",
            UNPATCHED_NOTE, ""]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if compat_matrix.yaml or SUMMARY.md would change (nothing written)")
    ap.add_argument("--no-summary", action="store_true")
    ap.add_argument("--matrix", default=str(MATRIX))
    args = ap.parse_args(argv)

    head_tree = head_src_tree()
    if head_tree is None:
        msg = "update_tested: not a git checkout (git rev-parse HEAD:src failed): nothing can be verified"
        if args.check:
            print(msg + "; --check skipped")
            return 0
        print(msg, file=sys.stderr)
    cells = load_cells()
    grouped = group(cells)
    rows = rows_from(grouped, head_tree)
    matrix = Path(args.matrix)
    old = matrix.read_text()
    new = replace_tested(old, render_tested(rows))
    validate(new)
    summary = render_summary(grouped, rows, head_tree)
    if args.check:
        stale = []
        if new != old:
            stale.append(f"{matrix.name}: tested table")
        if not args.no_summary and (not SUMMARY.exists() or SUMMARY.read_text() != summary):
            stale.append(str(SUMMARY.relative_to(ROOT)))
        if stale:
            print(f"update_tested --check: out of date with the committed results: {', '.join(stale)}"
                  " (run python3 scripts/update_tested.py and commit)")
            return 1
        print(f"update_tested --check: {len(rows)} rows agree with {len(cells)} result files")
        return 0
    if new != old:
        matrix.write_text(new)
    counts = {st: sum(r["status"] == st for r in rows) for st in ("verified", "broken", "stale", "untested")}
    print(f"{matrix.name}: {len(rows)} tested rows from {len(cells)} result files ("
          + ", ".join(f"{n} {st}" for st, n in counts.items()) + ")")
    if not args.no_summary:
        SUMMARY.write_text(summary)
        print(f"wrote {SUMMARY.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
