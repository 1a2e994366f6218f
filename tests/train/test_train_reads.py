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


def test_a_few_training_steps_give_a_finite_falling_loss(train, files):
    import torch
    from speculators.model import SpeculatorModel
    from speculators_compat_testbed.tiny_models import build_tiny_model

    torch.manual_seed(0)
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
    losses = []
    while len(losses) < STEPS:
        for batch in loader:
            _draft, loss, _metrics = model(**batch, **train_kwargs)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            if len(losses) == STEPS:
                break
    print(f"\nlosses over {STEPS} steps: " + " ".join(f"{x:.3f}" for x in losses))
    assert all(math.isfinite(x) for x in losses), losses
    assert min(losses[-3:]) < losses[0], f"the loss did not fall: {losses}"
