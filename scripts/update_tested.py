#!/usr/bin/env python3
"""Generate the ``tested:`` table of compat_matrix.yaml from real end-to-end results.

Reads every result JSON written by ``speculators_compat.testing.e2e_runner`` under
``benchmarks/results/e2e/`` and (if present) ``benchmarks/results/gpu/`` (recursively; files that
are not e2e results, e.g. throughput benchmarks, are skipped). Cells are keyed by what the JSON
says (installed versions, arch, platform, patched/unpatched), not by file name.

One row per (speculators, vLLM release, platform):

- ``verified``: every patched arch cell for that pair passed (``"passed": true``, no ``"error"``);
- ``broken``: a patched cell failed (evidence: that cell's error, one line);
- ``untested``: only unpatched cells were run for that pair.

Cells run with ``--overrides`` (model-config variants, e.g. MLA dims for GPU kernels), with
``--tensor-parallel-size`` other than 1, or of an arch outside ``STATUS_ARCHS`` (Llama and Qwen3,
what ``make test`` runs; MoE and multimodal cells live in benchmarks/results/arch) are
exploratory: they do not decide the status, but a failing one is named in the evidence.

vLLM builds are normalised to their release (``0.11.0.post2`` / ``0.16.0+cpu`` -> ``0.11.0`` /
``0.16.0``). When the same cell was run more than once, the newest file (mtime) wins.

Only the lines from the top-level ``tested:`` key to the next top-level key (or the end of the
file) are rewritten; the rest of the file is kept byte for byte. The new file is validated
(``load_matrix`` with the code's patch ids, when importable) before it is written.

Also writes ``benchmarks/results/e2e/SUMMARY.md`` (pair x arch table).

Usage::

    .venv/bin/python scripts/update_tested.py [--check] [--no-summary]

``--check``: exit 1 if the file would change (nothing written).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
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
E2E_COMMAND = (
    "cd /tmp && SPECULATORS_COMPAT_MODEL_CACHE=/work/main/.bed/models VLLM_CPU_KVCACHE_SPACE=1 "
    "timeout 1500 $PY -m speculators_compat.testing.e2e_runner --arch ARCH [--unpatched] "
    "--out /work/main/benchmarks/results/e2e/spec-S_vllm-V_ARCH[_unpatched].json"
)
UNPATCHED_NOTE = (
    "Unpatched cells are run with `SPECULATORS_COMPAT_DISABLE=1` in the environment as well as"
    " `--unpatched`: `python -m speculators_compat.testing.e2e_runner` imports (and so activates)"
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
    return tuple(int(x) for x in re.findall(r"\d+", version or "0"))


def _one_line(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Cell:
    def __init__(self, path: Path, data: dict):
        self.path = path
        self.data = data
        self.mtime = path.stat().st_mtime
        versions = data.get("versions") or {}
        self.speculators = str(versions.get("speculators"))
        self.vllm_build = str(versions.get("vllm"))
        self.vllm = release(versions.get("vllm"))
        self.platform = str(data.get("platform") or "cpu")
        self.arch = str(data.get("arch"))
        self.unpatched = bool(data.get("unpatched"))
        self.error = data.get("error")
        self.variant = (
            bool(data.get("overrides"))
            or (data.get("tensor_parallel_size") or 1) != 1
            or data.get("arch") not in STATUS_ARCHS
            or self.variant_name != self.arch  # a named variant file (e.g. ..._llama_v1runner.json)
        )
        self.passed = self._judge() and not self.error

    def _judge(self) -> bool:
        """Re-judge from the recorded measurements with the *current* tolerance of
        speculators_compat.testing.reference.TOLERANCE (a cell recorded under an older
        tolerance keeps its measured errors; only the threshold is applied anew)."""
        from speculators_compat.testing.reference import TOLERANCE

        cases = self.data.get("cases") or {}
        if not cases or self.error:
            return bool(self.data.get("passed"))
        tol = TOLERANCE.get(str(self.data.get("dtype")))
        ok = True
        for name, case in cases.items():
            if name == "repeat":
                ok &= bool(case.get("identical", False))
                continue
            ok &= bool(case.get("shapes_ok", False))
            err = case.get("max_error")
            if tol is None or not isinstance(err, (int, float)):
                ok &= bool(case.get("passed", False))
            else:
                ok &= err <= tol
                case["tolerance"] = tol
                case["passed"] = bool(case.get("shapes_ok", False)) and err <= tol
        return ok

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
    def variant_name(self) -> str:
        """The cell's name from its file (``e2e_spec-0.4.0.1_deepseek_v3_mla_moe.json`` ->
        ``deepseek_v3_mla_moe``), else the arch."""
        stem = self.path.stem
        prefix = f"e2e_spec-{self.speculators}_"
        return stem[len(prefix):] if stem.startswith(prefix) and len(stem) > len(prefix) else self.arch

    def error_line(self, limit: int = 160) -> str:
        """One line: how this cell failed (error type + message, or which check did not hold)."""
        if self.error:
            msg = str(self.error.get("message") or "").strip()
            first = msg.splitlines()[0] if msg else ""
            return _one_line(f"{self.error.get('type')}: {first}" if first else str(self.error.get("type")), limit)
        if self.passed:
            return "passed"
        bad = []
        for name, case in (self.data.get("cases") or {}).items():
            if not isinstance(case, dict):
                continue
            if name == "repeat":
                if not case.get("identical", True):
                    bad.append("repeat: not bit-identical")
            elif not case.get("passed", True):
                why = []
                if not case.get("shapes_ok", True):
                    why.append("shapes/ids wrong")
                if isinstance(case.get("max_error"), (int, float)):
                    why.append(f"max rel err {case['max_error']:.1e} > tol {case.get('tolerance', float('nan')):.0e}")
                bad.append(f"{name}: {', '.join(why) or 'failed'}")
        ref = "vLLM's own forward" if str(self.data.get("reference")).startswith("vllm") else "HF"
        return _one_line(f"mismatch vs {ref} (" + "; ".join(bad) + ")" if bad else "did not pass", limit)

    def error_type(self) -> str:
        if self.error:
            return str(self.error.get("type"))
        return "passed" if self.passed else "mismatch"


def load_cells(dirs=RESULT_DIRS) -> list[Cell]:
    cells = []
    for d in dirs:
        if not d.is_dir():
            continue
        for path in sorted(d.rglob("*.json")):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                print(f"skip {path}: {exc}", file=sys.stderr)
                continue
            if not isinstance(data, dict) or not {"arch", "versions", "unpatched"} <= data.keys():
                continue  # not an e2e cell (throughput etc.)
            cell = Cell(path, data)
            if cell.speculators in ("None", "") or cell.vllm in (None, "None"):
                print(f"skip {path}: versions missing", file=sys.stderr)
                continue
            cells.append(cell)
    return cells


def group(cells: list[Cell]) -> dict:
    """{pair: {"patched": {arch: Cell}, "unpatched": {arch: Cell}}}, newest file per cell."""
    out: dict = {}
    for c in sorted(cells, key=lambda c: c.mtime):
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


def rows_from(grouped: dict) -> list[dict]:
    rows = []
    for pair in sorted(grouped, key=_pair_sort):
        s, v, platform = pair
        patched, unpatched = grouped[pair]["patched"], grouped[pair]["unpatched"]
        variants = grouped[pair]["variants"]
        newest = max(c.mtime for c in [*patched.values(), *unpatched.values(), *variants.values()])
        date = _dt.datetime.fromtimestamp(newest, _dt.timezone.utc).strftime("%Y-%m-%d")
        unp = ""
        if unpatched:
            u = unpatched[_arch_sort(unpatched)[0]]
            unp = f"unpatched: {u.error_line(110)}"
        if not patched:
            status, evidence = "untested", ("only unpatched runs; " + unp) if unpatched else ""
        else:
            failed = [patched[a] for a in _arch_sort(patched) if not patched[a].passed]
            if failed:
                status = "broken"
                f = failed[0]
                ok = [a for a in _arch_sort(patched) if patched[a].passed]
                evidence = f"e2e {f.arch} failed: {f.error_line(200)}"
                if ok:
                    evidence += f"; passed: {','.join(ok)}"
            else:
                status = "verified"
                archs = _arch_sort(patched)
                errs = [patched[a].max_error for a in archs if patched[a].max_error is not None]
                dtypes = sorted({patched[a].dtype for a in archs})
                evidence = f"e2e {','.join(archs)} vs HF"
                if errs:
                    evidence += f" max rel err {max(errs):.1e}"
                evidence += f" ({','.join(dtypes)})"
                if unp:
                    evidence += "; " + unp
        ok_variants = [
            f"{a} {variants[a].max_error:.1e}" if variants[a].max_error is not None else a
            for a in sorted(variants) if variants[a].passed
        ]
        if ok_variants:
            evidence += f"; variants passed: {', '.join(ok_variants)}"
        for a in sorted(variants):
            if not variants[a].passed:
                evidence += f"; variant {a} (exploratory, not counted) failed: {variants[a].error_line(100)}"
        if not patched and not unpatched:
            status, evidence = "untested", evidence.lstrip("; ")
        rows.append(
            {"speculators": s, "vllm": v, "status": status, "platform": platform, "evidence": evidence, "date": date}
        )
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
            + ", ".join(f"{k}: {_q(r[k])}" for k in ("speculators", "vllm", "status", "platform", "evidence", "date"))
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


def render_summary(grouped: dict, rows: list[dict]) -> str:
    archs = _arch_sort({a for g in grouped.values() for a in [*g["patched"], *g["unpatched"]]})
    status = {(r["speculators"], r["vllm"], r["platform"]): r["status"] for r in rows}
    out = [
        "# End-to-end results: speculators' VllmHiddenStatesGenerator on vLLM, vs HF transformers",
        "",
        "Generated by `scripts/update_tested.py` from the JSON files in this folder"
        " (and `../gpu/` if present). Each cell: the generator built through speculators' own class on the"
        " installed vLLM, batteries `mixed`/`chunked`/`truncated`/`repeat`, every captured layer compared"
        " with HF transformers on the same weights. *max err* is the largest relative error over all cases.",
        "",
        "Command per cell (`$PY` = `python3 scripts/bed.py python --speculators S --vllm V`):",
        "",
        "```",
        E2E_COMMAND,
        "```",
        "",
        "| speculators | vLLM (build) | platform | status | "
        + " | ".join(f"{a} patched | {a} max err" for a in archs)
        + " | unpatched (llama) |",
        "|" + "---|" * (4 + 2 * len(archs) + 1),
    ]
    for pair in sorted(grouped, key=_pair_sort):
        g = grouped[pair]
        s, v, platform = pair
        builds = sorted({c.vllm_build for c in [*g["patched"].values(), *g["unpatched"].values()]})
        cols = [s, f"{v} ({', '.join(builds)})" if builds != [v] else v, platform, status.get(pair, "")]
        for a in archs:
            c = g["patched"].get(a)
            if c is None:
                cols += ["not run", ""]
                continue
            cols.append("PASS" if c.passed else "FAIL: " + c.error_line(90).replace("|", "\\|"))
            cols.append(f"{c.max_error:.2e} ({c.dtype})" if c.max_error is not None else "")
        u = g["unpatched"].get("llama") or next(iter(g["unpatched"].values()), None)
        if u is None:
            cols.append("not run")
        elif u.passed:
            cols.append("passed (!)")
        else:
            cols.append(f"{u.error_type()}: " + u.error_line(90).split(": ", 1)[-1].replace("|", "\\|"))
        out.append("| " + " | ".join(cols) + " |")
    out += ["", "Unpatched cells must fail: they record how speculators' generator breaks without the shim.",
            UNPATCHED_NOTE, ""]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if compat_matrix.yaml would change")
    ap.add_argument("--no-summary", action="store_true")
    ap.add_argument("--matrix", default=str(MATRIX))
    args = ap.parse_args(argv)

    cells = load_cells()
    grouped = group(cells)
    rows = rows_from(grouped)
    matrix = Path(args.matrix)
    old = matrix.read_text()
    new = replace_tested(old, render_tested(rows))
    validate(new)
    if args.check:
        if new != old:
            print(f"{matrix}: tested table is out of date (run scripts/update_tested.py)")
            return 1
        return 0
    if new != old:
        matrix.write_text(new)
    print(f"{matrix}: {len(rows)} tested rows from {len(cells)} result files"
          f" ({sum(r['status'] == 'verified' for r in rows)} verified,"
          f" {sum(r['status'] == 'broken' for r in rows)} broken)")
    if not args.no_summary:
        SUMMARY.write_text(render_summary(grouped, rows))
        print(f"wrote {SUMMARY}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
