"""generate's input checks with real torch and NumPy objects: one line each, nothing scheduled."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.contract

import numpy as np  # noqa: E402
import torch  # noqa: E402

from speculators_compat.extraction.inputs import check_layer_ids, check_token_ids, sequences, token_tensors  # noqa: E402


def _one_line(exc) -> str:
    text = str(exc.value)
    assert text and "\n" not in text
    return text


@pytest.mark.parametrize(
    "token_ids,words",
    [
        (np.array([[1, 2, 3], [4, 5, 6]]).reshape(2, 3, 1), "3-D"),
        (torch.tensor([1, 2, 3]), "one 1-D torch.Tensor of 3 ids"),
        (np.array([1, 2, 3]), "one 1-D numpy.ndarray of 3 ids"),
        (torch.empty(0, 5, dtype=torch.long), "cannot be empty"),
        (torch.ones(2, 3), "dtype torch.float32"),
        (np.ones((2, 3), dtype=bool), "dtype bool"),
        ([], "cannot be empty"),
        ("hello", "expected a list of token-id sequences"),
        ([torch.ones(3)], "token_ids[0] has dtype torch.float32"),
        ([torch.ones(2, 2, dtype=torch.long)], "token_ids[0] is a 2-D"),
        ([5, 6], "token_ids[0] is a int"),
    ],
)
def test_bad_shapes_and_kinds_are_one_line(token_ids, words):
    with pytest.raises(ValueError) as info:
        sequences(token_ids)
    assert words in _one_line(info)


def test_two_d_arrays_and_mixed_sequences_are_accepted():
    assert sequences(np.array([[1, 2], [3, 4]])) == [[1, 2], [3, 4]]
    assert sequences(torch.tensor([[1, 2], [3, 4]])) == [[1, 2], [3, 4]]
    seqs = sequences([torch.tensor([1, 2]), np.array([3], dtype=np.int32), (4, 5), [np.int64(6)]])
    assert seqs == [[1, 2], [3], [4, 5], [6]]
    check_token_ids(seqs, 10, token_tensors(seqs, torch))


@pytest.mark.parametrize(
    "seqs,words",
    [
        ([[1, True, 2]], "token_ids[0] holds True (bool)"),
        ([[1], [2.0]], "token_ids[1] holds 2.0 (float)"),
        ([[1], []], "token_ids[1] is empty"),
        ([[1, 10]], "token_ids[0][1] = 10 is outside"),
    ],
)
def test_bad_ids_are_one_line_on_both_paths(seqs, words):
    with pytest.raises(ValueError) as info:
        check_token_ids(seqs, 10, token_tensors(seqs, torch))
    assert words in _one_line(info)


def test_layer_ids_duplicates_and_kinds():
    assert check_layer_ids([3, 1, 2]) == ([1, 2, 3], [1, 2, 3])
    # speculators' default [2, n // 2, n - 3, n - 1] on a 4-layer model
    assert check_layer_ids([2, 2, 1, 3]) == ([1, 2, 3], [1, 2, 2, 3])
    with pytest.raises(ValueError) as info:
        check_layer_ids([])
    assert "empty" in _one_line(info)
    with pytest.raises(ValueError) as info:
        check_layer_ids([1, True])
    assert "holds True (bool)" in _one_line(info)
