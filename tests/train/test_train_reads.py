"""speculators' trainer reads what speculators' script wrote under the shim (issue #17 item 5).

Run by ``make train-check``: the data is extracted on the new vLLM (``tests/e2e/script_pipeline.py``
in the (0.4.0.1, vLLM 0.32) bed env), then read here, in an environment with speculators' own pins
(``scripts/bed.py python --speculators 0.4.0.1 --vllm none``: torch 2.10, transformers 4.57) — the
two-env recipe. Only speculators' code reads and trains: ``scripts/train.py`` of the v0.4.0.1
release (unmodified copy; its ``setup_dataloader`` and ``create_transformer_layer_config``),
``Eagle3SampleFileDataset``/``create_collate_fn`` and the Eagle-3 draft model, on CPU.
``TRAIN_CHECK_DATA`` names the folder of ``data_*.pt`` files.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import math
import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.train

DATA = os.environ.get("TRAIN_CHECK_DATA")
DATA_FP8 = os.environ.get("TRAIN_CHECK_DATA_FP8")  # the same extraction with SPECULATORS_COMPAT_STORE_DTYPE=fp8
CURVE_OUT = os.environ.get("TRAIN_CHECK_OUT")  # where the FP8-vs-bf16 loss curves are written (JSON)
CURVE_STEPS = 40
TRAIN_PY = Path(__file__).resolve().parents[1] / "e2e" / "speculators_scripts" / "v0.4.0.1" / "train.py"
TRAIN_PY_SHA256 = "95762e0c0ddb5fc68e0b1cee36d378a9f8a4d656718c742bc324ef2f2ddeaffa"
TOTAL_SEQ_LEN = 512
STEPS = 12

if not DATA:
    pytest.skip("TRAIN_CHECK_DATA is not set (run `make train-check`)", allow_module_level=True)
pytest.importorskip("speculators")


def _train_module(total_seq_len: int):
    assert hashlib.sha256(TRAIN_PY.read_bytes()).hexdigest() == TRAIN_PY_SHA256, "train.py differs from the release"
    spec = importlib.util.spec_from_file_location("speculators_train_script", TRAIN_PY)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    module.args = argparse.Namespace(total_seq_len=total_seq_len)  # what its __main__ sets
    return module


@pytest.fixture(scope="module")
def train():
    return _train_module(TOTAL_SEQ_LEN)


@pytest.fixture(scope="module")
def files():
    paths = sorted(str(p) for p in Path(DATA).glob("data_*.pt"))
    assert paths, f"no data_*.pt in {DATA}"
    return paths


def test_speculators_dataset_reads_every_file(files):
    import torch
    from speculators.train.data import Eagle3SampleFileDataset

    dataset = Eagle3SampleFileDataset(max_len=TOTAL_SEQ_LEN, file_list=files)
    assert len(dataset) == len(files)
    for i in range(len(dataset)):
        item = dataset[i]
        n = item["input_ids"].shape[0]
        hidden = item["verifier_last_hidden_states"].shape[-1]
        assert item["hidden_states"].shape[0] == n and item["hidden_states"].shape[-1] % hidden == 0
        assert item["loss_mask"].shape[0] == n
        assert torch.isfinite(item["hidden_states"]).all()


def _losses(train, files: list[str], steps: int, seed: int = 0) -> list[float]:
    """speculators' Eagle-3 draft trained ``steps`` steps on ``files`` (speculators' loader, noise on)."""
    import torch
    from speculators.model import SpeculatorModel
    from speculators_compat_testbed.tiny_models import build_tiny_model

    torch.manual_seed(seed)
    verifier = str(build_tiny_model("llama"))  # the same tiny Llama the data was extracted from
    layer_config = train.create_transformer_layer_config(verifier, num_layers=1, draft_arch="llama")
    if SpeculatorModel.registry_auto_discovery:
        SpeculatorModel.auto_populate_registry()
    model_class = SpeculatorModel.registry["eagle3"]
    options = dict(norm_before_residual=False, ttt_steps=3, ttt_step_loss_decay=1.0,
                   use_off_policy_tokens=False, verifier_name_or_path=verifier)
    model = model_class.from_training_args(verifier_config=layer_config, t2d=None, d2t=None,
                                           draft_vocab_size=layer_config.vocab_size, **options)
    train_kwargs, _ = model_class.get_trainer_kwargs(**options)
    loader = train.setup_dataloader(files, world_size=1, local_rank=0, add_noise=True,
                                    num_workers=1, prefetch_factor=2)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model.train()
    losses: list[float] = []
    while len(losses) < steps:
        for batch in loader:
            _draft, loss, _metrics = model(**batch, **train_kwargs)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            if len(losses) == steps:
                break
    return losses


def test_a_few_training_steps_give_a_finite_falling_loss(train, files):
    losses = _losses(train, files, STEPS)
    print(f"\nlosses over {STEPS} steps: " + " ".join(f"{x:.3f}" for x in losses))
    assert all(math.isfinite(x) for x in losses), losses
    assert min(losses[-3:]) < losses[0], f"the loss did not fall: {losses}"


def test_fp8_files_train_like_the_bf16_files(train, files):
    """The loss curve on the FP8 files stays closer to the bf16 curve (same seed) than two bf16
    curves of different seeds are to each other; the same FP8 files decoded without their scales
    (a wrong answer) do not."""
    if not DATA_FP8:
        pytest.skip("TRAIN_CHECK_DATA_FP8 is not set (run `make train-check`)")
    import json

    import speculators_compat
    from speculators_compat import storage

    fp8 = sorted(str(p) for p in Path(DATA_FP8).glob("data_*.pt"))
    assert [Path(p).name for p in fp8] == [Path(p).name for p in files]
    status = {r["id"]: r["status"] for r in speculators_compat.report()}
    assert status["train-data-fp8"] == "applied", status["train-data-fp8"]
    bf16_0 = _losses(train, files, CURVE_STEPS, seed=0)
    bf16_1 = _losses(train, files, CURVE_STEPS, seed=1)
    fp8_0 = _losses(train, fp8, CURVE_STEPS, seed=0)
    right = storage.dequantize_rows
    try:  # the control: FP8 values read without their per-row scales
        storage.dequantize_rows = lambda q, scale, dtype=None: right(q, scale.new_ones(scale.shape), dtype)
        unscaled = _losses(train, fp8, CURVE_STEPS, seed=0)
    finally:
        storage.dequantize_rows = right

    def gap(a, b):
        return sum(abs(x - y) for x, y in zip(a, b)) / len(a)

    result = {"steps": CURVE_STEPS, "bf16_seed0": bf16_0, "bf16_seed1": bf16_1, "fp8_seed0": fp8_0,
              "fp8_unscaled_seed0": unscaled, "gap_fp8_vs_bf16": gap(fp8_0, bf16_0),
              "gap_seed_noise": gap(bf16_1, bf16_0), "gap_unscaled_vs_bf16": gap(unscaled, bf16_0),
              "bytes_bf16": sum(Path(p).stat().st_size for p in files),
              "bytes_fp8": sum(Path(p).stat().st_size for p in fp8)}
    print("\n" + json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}, indent=1))
    if CURVE_OUT:
        from speculators_compat_testbed.provenance import provenance

        Path(CURVE_OUT).parent.mkdir(parents=True, exist_ok=True)
        Path(CURVE_OUT).write_text(json.dumps({"provenance": provenance(), **result}, indent=1) + "\n")
    assert all(math.isfinite(x) for x in fp8_0), fp8_0
    assert result["gap_fp8_vs_bf16"] < result["gap_seed_noise"], result
    assert result["gap_unscaled_vs_bf16"] > result["gap_seed_noise"], result  # the check can fail
