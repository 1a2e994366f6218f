"""``vllm_reference.assign_rows``: a forward's rows assigned to prompts from its token ids and
positions alone (the scheduled own-forward reference), chunk by chunk, padding left out."""

from speculators_compat_testbed.vllm_reference import assign_rows

PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10], [1, 5, 6, 11]]  # every one starts with BOS; 0 and 2 share a prefix


def _steps(steps):
    progress = [0] * len(PROMPTS)
    return [assign_rows(PROMPTS, [t for t, _ in s], [p for _, p in s], progress) for s in steps], progress


def test_chunks_over_forwards_and_neighbours_with_consecutive_positions():
    step0 = [(1, 0), (5, 1), (6, 2), (1, 0), (9, 1), (10, 2), (1, 0), (5, 1)]  # prompt 0: 3 rows, 1 whole, 2: 2 rows
    step1 = [(7, 3), (8, 4), (6, 2), (11, 3), (0, 0), (0, 0)]  # the rest of 0 and 2, then padding
    got, progress = _steps([step0, step1])
    assert got[0] == [(0, 0, 0, 3), (1, 0, 3, 3), (2, 0, 6, 2)]
    assert got[1] == [(0, 3, 0, 2), (2, 2, 2, 2)]
    assert progress == [5, 3, 4]


def test_a_shared_prefix_goes_to_the_longest_match_and_ties_to_the_earlier_prompt():
    got, _ = _steps([[(1, 0), (5, 1), (6, 2), (11, 3)]])  # prompt 2 whole: 0 matches only three rows
    assert got[0] == [(2, 0, 0, 4)]
    got, _ = _steps([[(1, 0)]])  # one BOS row: FCFS, the first prompt
    assert got[0] == [(0, 0, 0, 1)]


def test_a_row_of_no_prompt_ends_the_assignment_and_leaves_positions_unassigned():
    got, progress = _steps([[(1, 0), (5, 1), (99, 2), (7, 3)]])  # a wrong token at position 2
    assert got[0] == [(0, 0, 0, 2)] and progress[0] == 2  # the caller's coverage check then fails
