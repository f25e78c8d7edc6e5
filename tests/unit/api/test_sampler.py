"""ElasticSampler: exactly-once across resizes, equal step counts, plain state."""

import json

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from elastic.sampler import ElasticSampler


def make_world(length, world, state=None, **kwargs):
    """One sampler per rank, as the runtime sets them up after a re-formation."""
    samplers = []
    for rank in range(world):
        sampler = ElasticSampler(length, **kwargs)
        if state is not None:
            sampler.load_state_dict(state)
        sampler.set_rank(rank, world)
        samplers.append(sampler)
    return samplers


def run_steps(samplers, batch_size, steps=None, use_batches=False):
    """Simulate synchronous steps: every rank takes its batch k, then records it.

    Returns the indices consumed per step (all ranks together).
    """
    if use_batches:
        iterators = [iter(s.batches(batch_size)) for s in samplers]
    else:
        iterators = [iter(DataLoader(range(s.length), batch_size=batch_size, sampler=s)) for s in samplers]
    consumed = []
    batch_idx = 0
    while steps is None or batch_idx < steps:
        batches = [next(it, None) for it in iterators]
        if all(b is None for b in batches):
            break
        assert all(b is not None for b in batches), f"uneven batch counts at step {batch_idx}"
        for batch in batches:
            consumed.extend(int(i) for i in batch)
        for sampler in samplers:
            sampler.record_batch(batch_idx, batch_size)
        batch_idx += 1
    return consumed


@pytest.mark.parametrize("use_batches", [False, True])
def test_resizes_4_then_3_then_5_see_every_sample_exactly_once(use_batches):
    length, batch_size = 1000, 8
    world4 = make_world(length, 4, seed=7)
    consumed = run_steps(world4, batch_size, steps=10, use_batches=use_batches)
    state = world4[0].state_dict()
    assert all(s.state_dict() == state for s in world4)  # no communication needed
    assert state["prefix"] == len(consumed) and state["processed"] == []  # O(1) state

    world3 = make_world(length, 3, state=json.loads(json.dumps(state)), seed=7)
    consumed += run_steps(world3, batch_size, steps=7, use_batches=use_batches)
    state = world3[0].state_dict()

    world5 = make_world(length, 5, state=state, seed=7)
    consumed += run_steps(world5, batch_size, use_batches=use_batches)

    assert len(consumed) == length  # no duplicates...
    assert sorted(consumed) == list(range(length))  # ...and nothing missing
    assert world5[0].remaining_count == 0
    assert world5[0].processed_count == length


def test_rollback_to_a_commit_retrains_only_what_was_not_committed():
    length, batch_size = 300, 4
    world = make_world(length, 4, seed=1)
    first = run_steps(world, batch_size, steps=5)
    committed = world[0].state_dict()
    run_steps(world, batch_size, steps=3)  # trained, then lost with a failure before the next commit
    survivors = make_world(length, 3, state=committed, seed=1)
    rest = run_steps(survivors, batch_size)
    assert sorted(first + rest) == list(range(length))


def test_batches_give_equal_counts_when_the_tail_is_shorter_than_the_world():
    # 4 ranks, batch 5: 41 = 2 * 20 + 1 -> a plain DataLoader would give rank 0 a 3rd batch.
    world = make_world(41, 4, shuffle=False)
    lengths = [len(DataLoader(range(41), batch_size=5, sampler=s)) for s in world]
    assert lengths == [3, 2, 2, 2]
    counts = [len(s.batches(5)) for s in world]
    assert counts == [2, 2, 2, 2]
    consumed = run_steps(world, 5, use_batches=True)
    assert sorted(consumed) == list(range(41))


def test_drop_last_gives_equal_shares_and_leaves_the_tail_unprocessed():
    world = make_world(42, 4, drop_last=True)
    assert [len(s) for s in world] == [10, 10, 10, 10]
    consumed = run_steps(world, 3)
    assert len(consumed) == len(set(consumed)) == 40
    assert world[0].remaining_count == 2


def test_shares_are_disjoint_and_cover_the_remaining():
    world = make_world(23, 5, seed=3)
    shares = [list(s) for s in world]
    flat = [i for share in shares for i in share]
    assert sorted(flat) == list(range(23))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_shuffle_is_deterministic_per_seed_and_epoch():
    a, b, c = ElasticSampler(100, seed=5), ElasticSampler(100, seed=5), ElasticSampler(100, seed=6)
    assert list(a) == list(b)
    assert list(a) != list(c)
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first
    assert sorted(list(a)) == list(range(100))
    assert list(ElasticSampler(10, shuffle=False)) == list(range(10))


def test_set_epoch_clears_progress_only_for_a_new_epoch():
    sampler = ElasticSampler(50)
    list(sampler)
    sampler.record_batch(0, 10)
    assert sampler.processed_count == 10
    sampler.set_epoch(0)  # re-entry of train() after a re-formation, same epoch
    assert sampler.processed_count == 10
    sampler.set_epoch(1)
    assert sampler.processed_count == 0
    assert len(sampler) == 50


def test_out_of_order_indices_fold_into_the_prefix():
    sampler = ElasticSampler(10, shuffle=False)
    sampler.record_indices([2, 1])
    assert sampler.state_dict()["prefix"] == 0 and sampler.state_dict()["processed"] == [1, 2]
    sampler.record_indices([0])
    assert sampler.state_dict()["prefix"] == 3 and sampler.state_dict()["processed"] == []
    assert list(sampler) == list(range(3, 10))


def test_state_dict_is_plain_json_data_and_round_trips():
    sampler = ElasticSampler(TensorDataset(torch.zeros(20, 1)), seed=2)
    sampler.set_epoch(3)
    sampler.record_indices([4, 1, 9])
    sd = sampler.state_dict()
    assert json.loads(json.dumps(sd)) == sd == {"epoch": 3, "length": 20, "prefix": 0, "processed": [1, 4, 9],
                                                "seed": 2, "shuffle": True, "drop_last": False}
    other = ElasticSampler(20, seed=2)
    other.load_state_dict(sd)
    assert other.epoch == 3 and other.remaining_count == 17
    assert list(other) == list(sampler)


def test_invalid_input_raises_clear_errors():
    with pytest.raises(ValueError, match="num_replicas"):
        ElasticSampler(10).set_rank(0, 0)
    with pytest.raises(ValueError, match="rank must be"):
        ElasticSampler(10).set_rank(3, 3)
    with pytest.raises(ValueError, match="outside the dataset"):
        ElasticSampler(10).record_indices([10])
    with pytest.raises(ValueError, match="lacks"):
        ElasticSampler(10).load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="data set of 11"):
        ElasticSampler(10).load_state_dict({"epoch": 0, "length": 11, "prefix": 0, "processed": []})
    with pytest.raises(ValueError, match="length"):
        ElasticSampler(-1)


# -- the settings are part of the state (security review, finding 15) ------------------


@pytest.mark.parametrize("committed, now, line", [
    ({"seed": 0}, {"seed": 1}, "seed committed as 0, now 1"),
    ({"shuffle": True}, {"shuffle": False}, "shuffle committed as True, now False"),
    ({"drop_last": False}, {"drop_last": True}, "drop_last committed as False, now True"),
    ({"seed": 3, "drop_last": True}, {"seed": 4, "drop_last": False},
     "seed committed as 3, now 4; drop_last committed as True, now False"),
])
def test_a_resume_with_other_settings_is_refused_in_one_line_naming_them(committed, now, line):
    before = ElasticSampler(100, **committed)
    list(before)
    before.record_batch(0, 10)
    after = ElasticSampler(100, **now)
    with pytest.raises(ValueError) as refused:
        after.load_state_dict(json.loads(json.dumps(before.state_dict())))
    message = str(refused.value)
    assert line in message and "\n" not in message
    assert after.processed_count == 0  # nothing of the refused state was taken


def test_the_security_reviews_case_seed_0_then_1_no_longer_breaks_exactly_once_silently():
    world = make_world(100, 1, seed=0)
    run_steps(world, 10, steps=5)
    with pytest.raises(ValueError, match="seed committed as 0, now 1"):
        make_world(100, 1, state=world[0].state_dict(), seed=1)
    resumed = make_world(100, 1, state=world[0].state_dict(), seed=0)  # the same settings: it goes on
    assert resumed[0].processed_count == 50


def test_a_state_committed_before_the_settings_were_still_loads():
    old = {"epoch": 2, "length": 30, "prefix": 4, "processed": [29]}  # what a PR-era checkpoint holds
    sampler = ElasticSampler(30, seed=9, shuffle=False)
    sampler.load_state_dict(old)
    assert (sampler.epoch, sampler.processed_count) == (2, 5)
    assert list(sampler) == list(range(4, 29))
    assert sampler.state_dict()["seed"] == 9  # committed from now on


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(5))


class StreamWithLength(Stream):
    def __len__(self):
        return 5


@pytest.mark.parametrize("dataset", [Stream(), StreamWithLength(), (i for i in range(3))])
def test_a_data_set_without_indices_is_refused_naming_what_to_do_instead(dataset):
    with pytest.raises(TypeError) as refused:
        ElasticSampler(dataset)
    message = str(refused.value)
    assert "needs a data set with a length" in message and "shard a stream yourself" in message
    assert "\n" not in message


def test_iterating_again_after_the_epoch_yields_nothing_and_says_so_once(caplog):
    sampler = ElasticSampler(8, shuffle=False)
    loader = DataLoader(range(8), batch_size=2, sampler=sampler)
    for batch_idx, _ in enumerate(loader):
        sampler.record_batch(batch_idx, 2)
    with caplog.at_level("WARNING", logger="elastic.sampler"):
        assert list(loader) == [] and list(loader) == []  # exactly once: no repeat (elastic.horovod repeats)
    assert [r.getMessage() for r in caplog.records] == [
        "sampler: epoch 0 is complete: a pass yields nothing until set_epoch(1)"]
    sampler.set_epoch(1)
    assert len(list(loader)) == 4
