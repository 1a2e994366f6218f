"""FP8 storage (``storage.py``) and ``train-data-fp8`` on the real speculators trainer's dataset.

Rows are shaped like a trained model's: head-dim-aligned widths, a few very-high-norm rows (a
trained model's position 0) and a few high-magnitude channels. The bound on a row's error is
e4m3's own: half a step of 3 mantissa bits (2^-4 relative) plus the subnormals' absolute
step, which a wrong scale, a zeroed or a misplaced row exceeds many times (shown below).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.contract

pytest.importorskip("speculators")
torch = pytest.importorskip("torch")

import speculators_compat  # noqa: E402,F401  (activates the shim)
from speculators_compat import storage  # noqa: E402

BOUND = 2.0**-4 + 2.0**-8  # e4m3 half-step, plus bf16 rounding of the multiplier and the subnormal floor


def _rows(tokens=96, hidden=512, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g)
    h[:, :3] *= 40.0  # high-magnitude channels
    h[0] *= 300.0  # a very-high-norm first row
    h[17] *= 80.0
    h[5] = 0.0  # an all-zero row stays zero
    return h.to(dtype)


def _sample(layers=3, **kw):
    return {"input_ids": torch.arange(96), "loss_mask": torch.ones(96, dtype=torch.long),
            "hidden_states": [_rows(seed=i, **kw) for i in range(layers)]}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_stays_within_e4m3s_own_error(dtype):
    h = _rows(dtype=dtype)
    q, scale = storage.quantize_rows(h)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (h.shape[0],)
    assert torch.isfinite(q.float()).all()
    err = storage.row_errors(h, q, scale)
    assert float(err.max()) <= BOUND, float(err.max())
    assert float(err[5]) == 0.0 and bool((storage.dequantize_rows(q, scale)[5] == 0).all())
    assert 0.005 < float(err.mean()) < 0.05  # e4m3 rounding is really there (not a bf16 copy)


def test_the_bound_fails_a_wrong_answer():
    h = _rows()
    q, scale = storage.quantize_rows(h)
    misplaced = storage.row_errors(h, q.roll(1, dims=0), scale.roll(1, dims=0))
    wrong_scale = storage.row_errors(h, q, scale * 1.25)
    zeroed = storage.row_errors(h, torch.zeros_like(q), scale)
    unscaled = storage.row_errors(h, q, torch.ones_like(scale))
    for name, err in [("misplaced", misplaced), ("wrong scale", wrong_scale), ("zeroed", zeroed),
                      ("unscaled", unscaled)]:
        nonzero = err[[i for i in range(len(err)) if i != 5]]
        assert float(nonzero.max()) > 3 * BOUND, name


def test_encode_decode_keys_and_bytes(tmp_path):
    obj = _sample()
    coded = storage.encode(obj)
    assert "hidden_states" not in coded and coded[storage.FORMAT_KEY] == storage.FORMAT_FP8
    plain, fp8 = tmp_path / "bf16.pt", tmp_path / "fp8.pt"
    torch.save(obj, plain)
    torch.save(coded, fp8)
    assert fp8.stat().st_size < 0.6 * plain.stat().st_size
    back = storage.decode(torch.load(fp8, weights_only=True))
    assert set(back) == {"input_ids", "loss_mask", "hidden_states"}
    assert torch.equal(back["input_ids"], obj["input_ids"])
    for h, d in zip(obj["hidden_states"], back["hidden_states"]):
        assert d.shape == h.shape
        rel = (d - h.float()).norm(dim=-1) / h.float().norm(dim=-1).clamp_min(1e-30)
        assert float(rel.max()) <= BOUND
    assert storage.decode(obj) is obj  # a bf16 sample passes through
    m = storage.measured(obj, coded)
    assert m["rows"] == 96 and len(m["max"]) == 3 and max(m["max"]) <= BOUND


def _dataset_items(files):
    from speculators.train.data import Eagle3SampleFileDataset

    ds = Eagle3SampleFileDataset(max_len=256, file_list=[str(f) for f in files])
    return [ds[i] for i in range(len(ds))]


def test_speculators_dataset_reads_fp8_files_as_the_bf16_ones(tmp_path):
    import speculators.train.data  # noqa: F401  (the patch applies at its import)

    status = {r["id"]: r for r in speculators_compat.report()}["train-data-fp8"]
    assert status["status"] == "applied", status
    samples = [_sample(layers=4) for _ in range(2)]
    bf16, fp8 = [], []
    for i, obj in enumerate(samples):
        torch.save(obj, tmp_path / f"data_{i}.pt")
        (tmp_path / "fp8").mkdir(exist_ok=True)
        torch.save(storage.encode(obj), tmp_path / "fp8" / f"data_{i}.pt")
        bf16.append(tmp_path / f"data_{i}.pt")
        fp8.append(tmp_path / "fp8" / f"data_{i}.pt")
    for a, b in zip(_dataset_items(bf16), _dataset_items(fp8)):
        assert set(a) == set(b)
        for key in a:
            if "hidden_states" not in key:
                assert torch.equal(a[key], b[key]), key
                continue
            assert a[key].shape == b[key].shape and a[key].dtype == b[key].dtype
            rows = a[key].float().norm(dim=-1) > 0
            rel = (b[key] - a[key]).float().norm(dim=-1)[rows] / a[key].float().norm(dim=-1)[rows]
            # hidden_states joins 3 layers per row: its row error is a mean of the layers' (each <= BOUND)
            assert float(rel.max()) <= BOUND, (key, float(rel.max()))


def test_without_the_patch_speculators_refuses_fp8_files_loudly(tmp_path):
    torch.save(storage.encode(_sample(layers=4)), tmp_path / "data_0.pt")
    code = ("import speculators_compat, sys\n"
            "from speculators.train.data import Eagle3SampleFileDataset\n"
            f"ds = Eagle3SampleFileDataset(max_len=256, file_list=[{str(tmp_path / 'data_0.pt')!r}])\n"
            "ds[0]\n")
    env = dict(os.environ, SPECULATORS_COMPAT_PATCHES="-train-data-fp8")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "KeyError: 'hidden_states'" in out.stderr, out.stderr[-2000:]


def test_fp8_files_load_in_spawned_dataloader_workers(tmp_path, monkeypatch):
    """The decoding standardize_fn pickles: a DataLoader whose workers start with spawn reads FP8
    files (the workers start with the shim, as under ``speculators-compat run``)."""
    from speculators.train.data import Eagle3SampleFileDataset
    from torch.utils.data import DataLoader

    from speculators_compat.launcher import child_environment

    monkeypatch.setenv("PYTHONPATH", child_environment()["PYTHONPATH"])

    torch.save(storage.encode(_sample(layers=4)), tmp_path / "data_0.pt")
    ds = Eagle3SampleFileDataset(max_len=256, file_list=[str(tmp_path / "data_0.pt")])
    loader = DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="spawn")
    got, want = next(iter(loader)), ds[0]
    assert set(got) == set(want) and "hidden_states" in got
    for key in want:
        assert torch.equal(got[key], want[key]), key
