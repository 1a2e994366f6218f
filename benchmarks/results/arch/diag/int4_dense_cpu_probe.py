"""Diagnostic (not a cell): does a *dense* compressed-tensors W4A16 path run on CPU vLLM?

The released Kimi-K2.5 INT4 packs only routed experts, which CPU vLLM cannot run (INT4.md). This
packs every decoder Linear of the tiny llama (hidden 128) with the same helper
(``tiny_models.quantize_w4a16``: pack-quantized, int4 symmetric, group 32; ignore ``lm_head``),
runs speculators' generator on it (shim on, float32) and compares with HF on the dequantized
weights.

    PYTHONPATH=src <bed>/bin/python benchmarks/results/arch/diag/int4_dense_cpu_probe.py OUT.json [DTYPE]

DTYPE (default float32) is the engine's and HF's dtype.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import traceback


def main(out_path: str, dtype_name: str = "float32") -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import speculators_compat  # noqa: F401
    import torch
    from safetensors.torch import load_file, save_file

    from speculators_compat.testing import tiny_models as tm
    from speculators_compat.testing.e2e_runner import _force_engine_dtype
    from speculators_compat.testing.reference import compare, hf_layer_outputs, load_hf_model
    from speculators_compat.versions import installed_versions

    src = tm.build_tiny_model("llama")
    work = tempfile.mkdtemp(prefix="int4-dense-")
    qdir, ddir = os.path.join(work, "packed"), os.path.join(work, "dequantized")
    shutil.copytree(src, qdir)
    shutil.copytree(src, ddir)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    packed, deq = {}, {}
    linear = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
    n = 0
    for name, t in tensors.items():
        if linear.match(name):
            parts, d = tm.quantize_w4a16(t, t.dtype)
            for k, v in parts.items():
                packed[name[: -len(".weight")] + "." + k] = v
            deq[name] = d.to(t.dtype)
            n += 1
        else:
            packed[name] = deq[name] = t
    save_file(packed, os.path.join(qdir, "model.safetensors"), metadata={"format": "pt"})
    save_file(deq, os.path.join(ddir, "model.safetensors"), metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(qdir, "config.json")))
    qc = json.loads(json.dumps(tm.KIMI_K25_W4A16_QUANTIZATION_CONFIG))
    qc["ignore"] = ["lm_head"]
    cfg["quantization_config"] = qc
    json.dump(cfg, open(os.path.join(qdir, "config.json"), "w"), indent=1)
    from speculators_compat.testing.provenance import provenance

    result = {"provenance": provenance(), "model": "tiny llama, every decoder Linear W4A16 (pack-quantized, int4 sym, group 32)",
              "quantized_linears": n, "dtype": dtype_name, "versions": {k: v.version for k, v in installed_versions().items()}}
    try:
        dtype = getattr(torch, dtype_name)
        _force_engine_dtype(dtype_name)
        from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

        gen = VllmHiddenStatesGenerator(qdir, max_model_len=2048)
        seqs = [[1] + list(range(10, 300)), [1] + list(range(400, 460))]
        outs = gen.generate(seqs)
        ids = sorted(gen.layer_ids)
        try:
            gen.executor.shutdown()
        except Exception:  # noqa: BLE001
            pass
        hf = load_hf_model(ddir, dtype=dtype)
        ref = hf_layer_outputs(hf, seqs, ids, dtype=dtype)
        rep = compare([o["hidden_states"] for o in outs], ref, dtype=dtype)
        result.update(layer_ids=ids, max_error=rep.max_error, passed=rep.passed, summary=rep.summary(),
                      worst_row=rep.worst_row)
    except BaseException as exc:  # noqa: BLE001
        result["error"] = {"type": type(exc).__name__, "message": str(exc)[:2000], "traceback": traceback.format_exc()[-3000:]}
    from speculators_compat.testing.provenance import scrub_paths

    open(out_path, "w").write(json.dumps(scrub_paths(json.loads(json.dumps(result, default=str))), indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
