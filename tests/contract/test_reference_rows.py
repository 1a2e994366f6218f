"""reference.compare bounds every row: one wrong row of a real 2,047-token capture fails.

The fixture (data/llama_capture_2047.pt.xz) is a real capture: layer 3 of the tiny Llama, the
e2e runner's 2,047-token sequence, captured by speculators 0.4.0.1's generator on vLLM 0.32.0
(CPU, bf16), with the HF transformers reference of the same run. Each test injects one kind of
wrong row into the capture and must see FAIL; the unmodified capture must PASS.
"""

from __future__ import annotations

import io
import lzma
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")  # the bed envs have torch; this module needs nothing else

from speculators_compat_testbed.reference import ROW_TOLERANCE, TOLERANCE, compare, relative_error  # noqa: E402

pytestmark = pytest.mark.contract

FIXTURE = Path(__file__).parent / "data" / "llama_capture_2047.pt.xz"


@pytest.fixture(scope="module")
def real():
    data = torch.load(io.BytesIO(lzma.decompress(FIXTURE.read_bytes())), weights_only=False)
    assert data["capture"].shape == data["reference"].shape == (2047, 128)
    assert data["capture"].dtype == torch.bfloat16
    return data


def _check(capture, real):
    return compare([[capture]], [[real["reference"]]], "bfloat16")


def _distinct_neighbour_row(real, start: int) -> int:
    ids = real["token_ids"]
    i = start
    while int(ids[i]) == int(ids[i - 1]):
        i += 1
    return i


def test_unmodified_capture_passes(real):
    rep = _check(real["capture"].clone(), real)
    assert rep.passed, rep.summary()
    w = rep.worst_row
    # the measured figures behind ROW_TOLERANCE (reference.py): worst correct row ~2.3e-2
    assert 5e-3 < w["error"] < ROW_TOLERANCE["bfloat16"] / 3, w
    assert rep.rows_over == [[0]]
    assert rep.row_quantiles["rows"] == 2047


def test_zeroed_row_fails(real):
    cap = real["capture"].clone()
    cap[1500] = 0
    rep = _check(cap, real)
    assert not rep.passed, rep.summary()
    # the per-sequence Frobenius figure alone would not see it (this is why rows are bounded)
    assert rep.errors[0][0] <= TOLERANCE["bfloat16"]
    assert rep.worst_row["row"] == 1500 and rep.worst_row["error"] == pytest.approx(1.0)
    assert rep.rows_over == [[1]]
    assert "FAIL" in rep.summary() and "row 1500" in rep.summary()


def test_row_duplicated_from_neighbour_fails(real):
    i = _distinct_neighbour_row(real, 1000)
    cap = real["capture"].clone()
    cap[i] = cap[i - 1]
    rep = _check(cap, real)
    assert not rep.passed, rep.summary()
    # invisible to a Frobenius figure over all rows (the massive rows' share hides it)
    assert relative_error(cap, real["reference"]) <= TOLERANCE["bfloat16"]
    assert rep.worst_row["row"] == i and rep.worst_row["error"] > 3 * ROW_TOLERANCE["bfloat16"]


def test_misplaced_row_fails(real):
    cap = real["capture"].clone()
    cap[700] = real["capture"][1900]  # a row from elsewhere in the sequence
    rep = _check(cap, real)
    assert not rep.passed, rep.summary()
    assert rep.worst_row["row"] == 700 and rep.rows_over == [[1]]


def test_two_rows_swapped_fail(real):
    cap = real["capture"].clone()
    cap[[10, 2000]] = real["capture"][[2000, 10]]
    rep = _check(cap, real)
    assert not rep.passed and rep.rows_over == [[2]]


def test_shift_by_one_row_fails(real):
    cap = real["capture"].clone()
    cap[1:] = real["capture"][:-1]  # every row one position late (the first one duplicated)
    rep = _check(cap, real)
    assert not rep.passed
    assert rep.rows_over[0][0] > 2000


def test_tail_shift_fails(real):
    """Only the last rows shifted (a chunk boundary off by one near the end)."""
    cap = real["capture"].clone()
    cap[2040:] = real["capture"][2039:2046]
    rep = _check(cap, real)
    assert not rep.passed and 1 <= rep.rows_over[0][0] <= 7


def test_nan_row_fails(real):
    cap = real["capture"].clone()
    cap[3, 5] = float("nan")
    rep = _check(cap, real)
    assert not rep.passed and rep.worst_row["row"] == 3


def test_no_count_allowance():
    """compare() has no outlier allowance to pass a wrong row with."""
    import inspect

    params = inspect.signature(compare).parameters
    assert not any("outlier" in p for p in params), list(params)
