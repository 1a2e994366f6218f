"""Every environment variable speculators-compat reads, in one place, with one parser per kind.

Values are read at the moment they are asked for (workers inherit the caller's environment,
and tests change it), never cached. A malformed value is one clear ``SettingError`` naming the
variable and what it accepts; nothing falls back silently to a default.

README's table of variables is checked against ``SETTINGS`` (tests/unit/test_settings.py).
"""

from __future__ import annotations

import os

__all__ = ["SETTINGS", "Setting", "SettingError", "get", "flag", "number", "text"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class SettingError(ValueError):
    """An environment variable of speculators-compat holds a value it does not accept."""


class Setting:
    """One variable: ``kind`` is "flag", "number" or "text"; numbers must exceed ``minimum``.
    (A plain class: ``dataclasses`` would cost ~10 ms at ``import speculators_compat``.)"""

    __slots__ = ("name", "kind", "default", "doc", "minimum")

    def __init__(self, name: str, kind: str, default: object, doc: str, minimum: float | None = None):
        self.name, self.kind, self.default, self.doc, self.minimum = name, kind, default, doc, minimum


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in [
        Setting("SPECULATORS_COMPAT_DISABLE", "flag", False, "do nothing"),
        Setting("SPECULATORS_COMPAT_AUTO", "flag", False,
                "activate in every Python process of the environment (the wheel's `.pth` hook), "
                "as `speculators-compat run` does for one command"),
        Setting("SPECULATORS_COMPAT_STRICT", "flag", False,
                "an untested combination or a failed probe raises (reaches workers)"),
        Setting("SPECULATORS_COMPAT_PATCHES", "text", None,
                "`id1,id2`: only these (a failure raises) · `-id1,-id2`: all but these"),
        Setting("SPECULATORS_COMPAT_MATRIX", "text", None, "your own matrix file (validated like ours)"),
        Setting("SPECULATORS_COMPAT_KV_CACHE_BYTES", "number", None,
                "the free memory the generator sizes its KV cache from (speculators takes 16% of it)",
                minimum=0),
        Setting("SPECULATORS_COMPAT_ATTENTION_BACKEND", "text", None,
                "attention backend for the generator's engine, e.g. `TRITON_ATTN`"),
        Setting("SPECULATORS_COMPAT_ADDITIONAL_CONFIG", "text", None,
                "a JSON object for the generator's engine `additional_config` (vLLM's `--additional-config`), "
                "e.g. `{\"gdn_prefill_backend\": \"triton\"}`"),
        Setting("SPECULATORS_COMPAT_SHM_DIR", "text", None,
                "where captured states are exchanged (default `/dev/shm`)"),
        Setting("SPECULATORS_COMPAT_RPC_TIMEOUT", "number", 600.0,
                "seconds a shim RPC to the workers may take before `generate` fails", minimum=0),
        Setting("SPECULATORS_COMPAT_PIN", "flag", True, "page-lock the exchange buffers on GPUs"),
        Setting("SPECULATORS_COMPAT_PIPELINE", "flag", True,
                "two batches in flight where the executor takes futures (off: serial driver, "
                "async scheduling left off)"),
        Setting("SPECULATORS_COMPAT_ASYNC_SCHEDULING", "flag", True,
                "the workers' async scheduling on accelerators (with the pipelined driver)"),
        Setting("SPECULATORS_COMPAT_EXECUTOR", "text", None,
                "`ray`: the generator's engine on vLLM's Ray executor (default `mp`: MultiprocExecutor)"),
        Setting("SPECULATORS_COMPAT_PIPELINE_PARALLEL_SIZE", "number", 1.0,
                "pipeline stages of the generator's engine (`pipeline_parallel_size`)", minimum=0),
        Setting("SPECULATORS_COMPAT_OUTPUT_RESUME", "text", "auto",
                "speculators' script under `run`: `auto` resumes a folder made by the same run (refuses "
                "another's) · `restart` deletes its data files first"),
        Setting("SPECULATORS_COMPAT_OUTPUT_FSYNC", "flag", False,
                "fsync each data file and the manifest before they count as written (power-loss safe)"),
        Setting("SPECULATORS_COMPAT_SELF_CHECK_EVERY", "number", 64.0,
                "speculators' script under `run`: sample 0 joins every Nth batch again and its rows must "
                "match its first capture (the run stops if not; 0: off)", minimum=-1),
        Setting("SPECULATORS_COMPAT_SELF_CHECK_ROWS", "number", 16.0,
                "rows per sampled step that a checked generate() call (which ones: the budget below) compares with the engine's own token ids, "
                "positions, layer outputs and final norm (a mismatch fails the call; 0: off)", minimum=-1),
        Setting("SPECULATORS_COMPAT_SELF_CHECK_BUDGET", "number", 0.005,
                "share of the calls' time the row self-check may take: the first call is checked, later ones "
                "while the checks so far (their timed work, doubled) stay within it (1: every call)", minimum=0),
        Setting("SPECULATORS_COMPAT_DTYPE", "text", None,
                "the generator engine's dtype (`float32`, `bfloat16`, `float16`; default: speculators' `auto`)"),
        Setting("SPECULATORS_COMPAT_MAX_NUM_BATCHED_TOKENS", "number", 0.0,
                "tokens per engine step (`max_num_batched_tokens`; longer prompts are prefilled in chunks); "
                "0: speculators' choice", minimum=-1),
        Setting("SPECULATORS_COMPAT_SAVE_PROCESS", "flag", False,
                "speculators' script under `run`: bf16 data files are written by one saver process reading the "
                "captured rows from shared memory (no pickling, writing or hashing in the driver's process); "
                "off: by save threads in it (on an H100 the saver process was not yet faster)"),
        Setting("SPECULATORS_COMPAT_SAVE_BUFFER_MB", "number", 2048.0,
                "the script's samples waiting to be saved, at most (MiB); the loop waits beyond it", minimum=0),
        Setting("SPECULATORS_COMPAT_STORE_DTYPE", "text", "auto",
                "speculators' script under `run`: `fp8` stores hidden states as float8 e4m3 with a scale per row "
                "(half the bytes of bf16; speculators' trainer reads them under the shim) · `auto`: as captured"),
    ]
}


def _setting(name: str) -> Setting:
    try:
        return SETTINGS[name]
    except KeyError:
        raise KeyError(f"{name} is not a speculators-compat setting") from None


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    return value.strip()


def flag(name: str) -> bool:
    s = _setting(name)
    raw = _raw(name)
    if raw is None:
        return bool(s.default)
    low = raw.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise SettingError(f"{name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")


def number(name: str) -> float | None:
    s = _setting(name)
    raw = _raw(name)
    if raw is None:
        return s.default  # type: ignore[return-value]
    try:
        value = float(raw)
    except ValueError:
        raise SettingError(f"{name}={raw!r}: expected a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise SettingError(f"{name}={raw!r}: expected a finite number")
    if s.minimum is not None and not value > s.minimum:
        raise SettingError(f"{name}={raw!r}: expected a number greater than {s.minimum:g}")
    return value


def text(name: str) -> str | None:
    s = _setting(name)
    raw = _raw(name)
    return s.default if raw is None else raw  # type: ignore[return-value]


def number_set(name: str) -> float:
    """``number`` of a setting that has a default (never None)."""
    value = number(name)
    if value is None:
        raise SettingError(f"{name}: not set and no default")
    return value


def get(name: str) -> bool | float | str | None:
    kind = _setting(name).kind
    return {"flag": flag, "number": number, "text": text}[kind](name)
