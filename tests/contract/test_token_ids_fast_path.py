"""The vectorised token-id check gives the same verdicts and messages as the per-id check (torch needed)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.contract

torch = pytest.importorskip("torch")

from speculators_compat.extraction.inputs import check_token_ids as _check_token_ids  # noqa: E402
from speculators_compat.extraction.inputs import token_tensors as _token_tensors  # noqa: E402

BAD = [
    ([[1, 2], []], r"token_ids\[1\] is empty"),
    ([[1, 100]], r"token_ids\[0\]\[1\] = 100 is outside"),
    ([[1, -1]], r"token_ids\[0\]\[1\] = -1 is outside"),
    ([[1, 2.5]], r"holds 2.5 \(float\)"),
    ([[1, 2**70]], r"is outside"),
]


@pytest.mark.parametrize("sequences, message", BAD)
def test_fast_path_refuses_what_the_slow_path_refuses(sequences, message):
    tensors = _token_tensors(sequences, torch)
    with pytest.raises(ValueError, match=message):
        _check_token_ids(sequences, 100, tensors)


def test_fast_path_tensors_are_the_ids():
    seqs = [[0, 99, 5], [7], [1, 3]]
    tensors = _token_tensors(seqs, torch)
    _check_token_ids(seqs, 100, tensors)
    assert [t.dtype for t in tensors] == [torch.long] * 3
    assert [t.tolist() for t in tensors] == [[0, 99, 5], [7], [1, 3]]
    assert _token_tensors([[True, 3]], torch) is None  # bools leave the fast path and are refused


def test_non_integers_leave_the_fast_path():
    assert _token_tensors([[1, 2.5]], torch) is None
    assert _token_tensors([[1, "a"]], torch) is None
