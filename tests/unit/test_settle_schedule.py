"""The settle's record of the generator's own schedule (test bed, no engine)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit


def test_generator_schedule_reads_like_the_references():
    """The generator's steps (request id -> rows) as vllm_reference's per-sequence schedule, so the
    settle can say which sequences the reference split otherwise (a wrong split fails here)."""
    from speculators_compat_testbed.e2e_runner import _per_sequence

    steps = [{"req_3_0": 925, "req_3_1": 950}, {"req_3_2": 100, "req_3_1": 30}, {"req_3_2": 28}]
    assert _per_sequence(steps, 3) == [[[0, 0, 925]], [[0, 0, 950], [950, 1, 30]], [[0, 1, 100], [100, 2, 28]]]
    assert _per_sequence(steps, 3) != [[[0, 0, 925]], [[0, 0, 980]], [[0, 1, 128]]]
