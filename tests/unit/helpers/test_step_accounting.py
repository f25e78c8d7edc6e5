"""committed_samples: what the sampler test counts must catch a sampler bug, and only that."""

import pytest

from tests.fakes.steps import committed_samples, missing_steps, step_attempts, steps_run_again


def record(step, round_, rank, batch):
    return {"step": step, "round": round_, "rank": rank, "batch": batch}


def test_a_killed_rank_that_never_logged_its_share_is_still_counted():
    steps = [record(1, 1, 0, [0, 1, 2]), record(1, 1, 1, [0, 1, 2]), record(1, 1, 2, [0, 1, 2]),
             # rank 2 died after step 2's all-reduce: only the survivors logged it
             record(2, 1, 0, [3, 4, 5]), record(2, 1, 1, [3, 4, 5]),
             record(3, 2, 0, [6, 7]), record(3, 2, 1, [6, 7])]
    assert committed_samples(steps) == list(range(8))


def test_a_step_run_again_after_a_rollback_counts_once():
    steps = [record(1, 1, 0, [0, 1, 2]), record(2, 1, 0, [3, 4, 5]),
             record(2, 2, 0, [3, 4]), record(3, 2, 0, [5, 6])]
    assert committed_samples(steps) == list(range(7))


def test_a_sample_seen_twice_is_caught():
    steps = [record(1, 1, 0, [0, 1]), record(2, 1, 0, [1, 2])]
    assert committed_samples(steps) != list(range(3))


def test_a_missing_sample_is_caught():
    steps = [record(1, 1, 0, [0, 1]), record(2, 1, 0, [3])]
    assert committed_samples(steps) != list(range(4))


def test_ranks_that_disagree_on_a_batch_fail():
    with pytest.raises(AssertionError, match="ranks disagree on step 1"):
        committed_samples([record(1, 1, 0, [0, 1]), record(1, 1, 1, [0, 2])])


def test_a_step_no_rank_logged_fails():
    with pytest.raises(AssertionError, match="missing from every log"):
        committed_samples([record(1, 1, 0, [0]), record(3, 1, 0, [2])])


def test_a_step_recorded_only_under_the_survivors_old_ranks_is_not_missing():
    # The soak's rank 0 was killed after step 2's all-reduce, before its record: the
    # survivors (ranks 1 and 2 of round 1) recorded and committed it; round 2 goes on.
    steps = [record(1, 1, 0, None), record(1, 1, 1, None), record(1, 1, 2, None),
             record(2, 1, 1, None), record(2, 1, 2, None),
             record(3, 2, 0, None), record(3, 2, 1, None)]
    attempts = step_attempts(steps)
    assert missing_steps(attempts, 3) == []
    assert steps_run_again(attempts) == 0


@pytest.mark.parametrize("steps, last, missing, again", [
    # a rollback: step 2 of round 1 run again in round 2
    ([record(1, 1, 0, None), record(2, 1, 1, None), record(2, 2, 0, None), record(3, 2, 0, None)], 3, [], 1),
    # a step nobody recorded
    ([record(1, 1, 0, None), record(3, 1, 0, None)], 3, [2], 0),
    # ranks of one round recording the same step: one attempt
    ([record(1, 1, 0, None), record(1, 1, 1, None), record(1, 1, 2, None)], 1, [], 0),
    # the last steps missing
    ([record(1, 1, 0, None)], 3, [2, 3], 0),
])
def test_attempts_table(steps, last, missing, again):
    attempts = step_attempts(steps)
    assert missing_steps(attempts, last) == missing
    assert steps_run_again(attempts) == again
