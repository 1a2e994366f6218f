"""speculators' own ``data_generation_offline.py`` (the released file, unmodified) under
``speculators-compat run``: the chat data, the tiny chat model and the command.

Used by ``tests/e2e/test_script.py`` and by ``make train-check`` (``python tests/e2e/script_pipeline.py
OUT_DIR`` writes the data a training test then reads in another environment).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE / "speculators_scripts"
SCRIPT_SHA256 = {
    "v0.3.0": "1d9ca21ab427eaeb4a0a963dc8412ea007360121dc46281d7be67016816d3b5b",
    "v0.4.0.1": "64be7cd166dbcdccf2ba703bf58d8c3c7d3ac49847978540b0e66fb4c5a89b53",
}
SEQ_LENGTH = 192  # the script's --seq-length: preprocessing truncates to it, the engine's max_model_len
LAYER_IDS = [0, 1, 2, 3]  # all 4 layers of the tiny model: 3 fused + the last, as Eagle-3 training expects
BATCH_SIZE = 4

_SENT = [
    "the quick brown fox jumps over the lazy dog",
    "what is a draft model and how does it verify tokens",
    "speculative decoding uses a small model to draft tokens for the target model",
    "hidden states of each layer form the residual stream",
    "python code with a function that will return a list of numbers",
    "once upon a time there lived a small robot who liked numbers",
    "why does the attention head read the key value cache",
    "the router picks an expert for every token in the mixture",
]


def chat_rows() -> list[dict]:
    """ShareGPT-style conversations: single- and multi-turn, a system turn, role spellings of
    both kinds, and one conversation far longer than SEQ_LENGTH tokens (truncated inside its answer)."""
    s = _SENT
    rows = [
        {"conversations": [{"from": "human", "value": s[1]}, {"from": "gpt", "value": s[2]}]},
        {"conversations": [{"from": "human", "value": s[0]}, {"from": "gpt", "value": s[3]},
                           {"from": "human", "value": s[6]}, {"from": "gpt", "value": s[7] + ". " + s[4]}]},
        {"conversations": [{"role": "system", "content": s[5]}, {"role": "user", "content": s[4]},
                           {"role": "assistant", "content": s[1] + " " + s[2]}]},
        {"conversations": [{"from": "human", "value": s[7]}, {"from": "gpt", "value": s[5]},
                           {"from": "human", "value": s[3]}, {"from": "gpt", "value": s[0]},
                           {"from": "human", "value": s[2]}, {"from": "gpt", "value": s[6]}]},
        {"conversations": [{"from": "human", "value": s[6]},  # over-length: cut inside the answer
                           {"from": "gpt", "value": ". ".join(reversed(s * 4))}]},
        {"conversations": [{"from": "human", "value": s[4]}, {"from": "gpt", "value": s[1]}]},
    ]
    return rows


def write_chat_jsonl(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in chat_rows()))
    return path


def installed_speculators() -> str:
    from importlib.metadata import version

    return version("speculators")


def script_for(speculators_version: str) -> Path:
    """The released script of this speculators version (0.4.0's equals 0.4.0.1's), checked."""
    tag = "v0.3.0" if speculators_version == "0.3.0" else "v0.4.0.1" if speculators_version.startswith("0.4.") else None
    if tag is None:
        raise LookupError(f"no copy of speculators' script for speculators {speculators_version}")
    path = SCRIPTS / tag / "data_generation_offline.py"
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SCRIPT_SHA256[tag]:
        raise AssertionError(f"{path} differs from speculators' {tag} release file (sha256 {digest})")
    return path


def tiny_chat_model() -> Path:
    from speculators_compat_testbed.tiny_models import build_tiny_model

    return build_tiny_model("llama")


def script_args(model_dir: Path, data: Path, out_dir: Path, work: Path) -> list[str]:
    """The script's own options, as a user passes them (no --tensor-parallel-size: its default)."""
    return [
        "--target-model-path", str(model_dir),
        "--train-data-path", str(data),
        "--output-dir", str(out_dir),
        "--seq-length", str(SEQ_LENGTH),
        "--layer-ids", *map(str, LAYER_IDS),
        "--batch-size", str(BATCH_SIZE),
        "--num-preprocessing-workers", "1",
        "--token-freq-path", str(work / "token_freq.pt"),
        "--hf-cache-dir", str(work / "hf_datasets"),
    ]


def run_script(work: Path, timeout: float = 1500, launcher: bool = True, extra_env: dict | None = None) -> dict:
    """Run the released script on the chat data with the tiny model; return what happened."""
    work.mkdir(parents=True, exist_ok=True)
    data = write_chat_jsonl(work / "chat.jsonl")
    model_dir = tiny_chat_model()
    out_dir = work / "out"
    script = script_for(installed_speculators())
    command = [sys.executable, str(script), *script_args(model_dir, data, out_dir, work)]
    if launcher:
        command = [sys.executable, "-m", "speculators_compat", "run", *command]
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["HF_HUB_OFFLINE"] = "1"
    env["HF_DATASETS_OFFLINE"] = "1"
    env.update(extra_env or {})
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
    elapsed = time.perf_counter() - start
    (work / "script.stdout").write_text(proc.stdout)
    (work / "script.stderr").write_text(proc.stderr)
    return {
        "returncode": proc.returncode,
        "stdout": proc.stdout,
        "stderr": proc.stderr,
        "seconds": elapsed,
        "out_dir": out_dir,
        "model_dir": model_dir,
        "data": data,
        "work": work,
        "script": script,
    }


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/e2e/script_pipeline.py WORK_DIR", file=sys.stderr)
        return 2
    import speculators_compat  # noqa: F401  (the tiny-model factory imports transformers)

    store = os.environ.get("SPECULATORS_COMPAT_STORE_DTYPE")  # make train-check: both formats
    r = run_script(Path(argv[0]).resolve(), extra_env={"SPECULATORS_COMPAT_STORE_DTYPE": store} if store else None)
    print(f"script exit {r['returncode']} in {r['seconds']:.0f} s; files in {r['out_dir']}")
    if r["returncode"] != 0:
        print(r["stderr"][-3000:], file=sys.stderr)
    return r["returncode"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
