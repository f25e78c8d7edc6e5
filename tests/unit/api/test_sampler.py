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
    assert json.loads(json.dumps(sd)) == sd == {"epoch": 3, "length": 20, "prefix": 0, "processed": [1, 4, 9]}
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
