"""Constant global batch: the layout as properties (hypothesis), the loss rule, accumulate."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import elastic
from elastic.global_batch import split_evenly
from elastic.sampler import ElasticSampler


class World:
    """One sampler per rank after a (re-)formation, stepping synchronously."""

    def __init__(self, length, world, state=None, *, global_batch_size, micro_batch_size=None, **kwargs):
        self.world, self.micro = world, micro_batch_size
        self.samplers = []
        for rank in range(world):
            sampler = ElasticSampler(length, **kwargs)
            if state is not None:
                sampler.load_state_dict(json.loads(json.dumps(state)))  # as committed: plain data
            sampler.set_rank(rank, world)
            self.samplers.append(sampler)
        batch_samplers = [s.batches(global_batch_size=global_batch_size, micro_batch_size=micro_batch_size)
                          for s in self.samplers]
        counts = {len(b) for b in batch_samplers}
        assert len(counts) == 1, f"unequal step counts {counts}"
        self.steps_left = counts.pop()
        self.iterators = [iter(b) for b in batch_samplers]
        self.batch_idx = 0

    def step(self):
        """One synchronous step: the global batch (in order), or None at the end of the pass."""
        items = [next(it, None) for it in self.iterators]
        if all(item is None for item in items):
            assert self.steps_left == 0
            return None
        assert all(item is not None for item in items), f"uneven step counts at step {self.batch_idx}"
        if self.micro is None:
            shares = items
        else:
            assert len({len(item) for item in items}) == 1, "micro-batch counts differ between ranks"
            assert all(len(mb) <= self.micro for item in items for mb in item)
            shares = [[i for mb in item for i in mb] for item in items]
        size = sum(map(len, shares))
        assert {len(s) for s in shares} <= {size // self.world, -(-size // self.world)}
        assert all(s.loss_scale == self.world / size for s in self.samplers)
        batch = [shares[i % self.world][i // self.world] for i in range(size)]  # shares are batch[r::W]
        for sampler in self.samplers:
            sampler.record_batch(self.batch_idx)
        self.batch_idx += 1
        self.steps_left -= 1
        return batch

    def state(self):
        states = [s.state_dict() for s in self.samplers]
        assert all(s == states[0] for s in states)  # no communication needed
        return states[0]


def run_to_end(world):
    batches = []
    while (batch := world.step()) is not None:
        batches.append(batch)
    return batches


phases = st.lists(
    st.tuples(st.integers(1, 16), st.integers(0, 6), st.integers(0, 3)),  # world, committed steps, lost steps
    min_size=1, max_size=5,
)


@settings(max_examples=150, deadline=None)
@given(
    length=st.integers(0, 250), global_batch=st.integers(1, 64), schedule=phases, last_world=st.integers(1, 16),
    micro=st.one_of(st.none(), st.integers(1, 12)), drop_last=st.booleans(), seed=st.integers(0, 3),
)
def test_global_batches_are_those_of_a_world_of_one_across_resizes_and_rollbacks(
    length, global_batch, schedule, last_world, micro, drop_last, seed
):
    options = dict(global_batch_size=global_batch, micro_batch_size=micro, drop_last=drop_last, seed=seed)
    reference = run_to_end(World(length, 1, **options))
    committed, state = [], None
    for world_size, steps, lost in schedule:
        world = World(length, world_size, state, **options)
        for _ in range(steps):
            batch = world.step()
            if batch is None:
                break
            committed.append(batch)
            state = world.state()  # a commit after every step
        for _ in range(lost):
            world.step()  # trained, then lost with a failure: the next world starts from `state`
    committed += run_to_end(World(length, last_world, state, **options))

    assert committed == reference
    seen = [i for batch in committed for i in batch]
    assert len(seen) == len(set(seen))  # once per epoch...
    short_tail = length % global_batch if drop_last else 0
    assert len(seen) == length - short_tail  # ...and nothing missed (drop_last: only a short last batch)
    assert all(len(b) == global_batch for b in committed[:-1])


@settings(max_examples=100, deadline=None)
@given(share=st.lists(st.integers(), max_size=40), pieces=st.integers(1, 12))
def test_split_evenly_keeps_order_and_sizes_differ_by_at_most_one(share, pieces):
    parts = split_evenly(share, pieces)
    assert len(parts) == pieces
    assert [i for p in parts for i in p] == share
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_uneven_shares_of_100_over_3_ranks_and_a_short_last_batch():
    world = World(230, 3, global_batch_size=100, shuffle=False)
    assert [len(s) for s in world.samplers[0].batches(global_batch_size=100)] == [34, 34, 10]
    assert [len(s) for s in world.samplers[2].batches(global_batch_size=100)] == [33, 33, 10]
    assert world.samplers[0].loss_scale == 3 / 100
    assert [len(b) for b in run_to_end(world)] == [100, 100, 30]
    assert world.samplers[0].processed_count == 230


def test_a_last_batch_smaller_than_the_world_gives_empty_shares_on_every_step_count():
    samplers = World(10, 4, global_batch_size=8, shuffle=False).samplers
    per_rank = [list(s.batches(global_batch_size=8)) for s in samplers]
    assert [[len(b) for b in batches] for batches in per_rank] == [[2, 1], [2, 1], [2, 0], [2, 0]]
    micro = [list(s.batches(global_batch_size=8, micro_batch_size=1)) for s in samplers]
    assert [[len(step) for step in steps] for steps in micro] == [[2, 1]] * 4
    assert micro[3][1] == [[]]


def test_drop_last_skips_only_a_short_last_global_batch():
    world = World(230, 3, global_batch_size=100, drop_last=True, shuffle=False)
    assert [len(b) for b in run_to_end(world)] == [100, 100]
    assert world.samplers[0].remaining_count == 30
    assert world.samplers[0].loss_scale == 3 / 100


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7, 16])
def test_sum_loss_times_loss_scale_averaged_over_ranks_is_the_mean_loss_gradient(world_size):
    torch.manual_seed(0)
    x, y = torch.randn(37, 5, dtype=torch.float64), torch.randint(0, 3, (37,))
    weight = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)

    def gradient(loss):
        weight.grad = None
        loss.backward()
        return weight.grad.clone()

    samplers = World(37, world_size, global_batch_size=16).samplers
    steps = [list(s.batches(global_batch_size=16)) for s in samplers]
    for k in range(3):  # 16, 16, then the short last batch of 5
        everything = [i for rank_steps in steps for i in rank_steps[k]]
        expected = gradient(F.cross_entropy(x[everything] @ weight.T, y[everything]))
        scales = {s.loss_scale for s in samplers}
        assert scales == {world_size / len(everything)}
        scale = scales.pop()
        # What DDP computes: each rank's gradient, all-reduced, divided by W.
        total = sum(
            gradient(F.cross_entropy(x[rank_steps[k]] @ weight.T, y[rank_steps[k]], reduction="sum") * scale)
            for rank_steps in steps
        ) / world_size
        assert torch.allclose(total, expected, rtol=0, atol=1e-14)
        for sampler in samplers:
            sampler.record_batch(k)


def test_record_batch_takes_no_size_for_global_batches_and_rejects_a_wrong_one():
    sampler = ElasticSampler(50, shuffle=False)
    batches = sampler.batches(global_batch_size=20)
    first = next(iter(batches))
    sampler.record_batch(0)
    assert sampler.state_dict()["prefix"] == 20 and first == list(range(20))
    sampler.record_batch(1, 20)  # the size, when given, must be G
    with pytest.raises(ValueError, match="global batches of 20"):
        sampler.record_batch(2, 4)
    sampler.batches(4)  # back to per-rank batches: the size is needed again
    with pytest.raises(ValueError, match="per-rank batch_size"):
        sampler.record_batch(0)


def test_the_per_rank_api_is_unchanged_by_the_global_mode():
    sampler = ElasticSampler(41, shuffle=False)
    sampler.set_rank(0, 4)
    assert len(sampler.batches(5)) == 2 and sampler.global_batch_size is None
    with pytest.raises(ValueError, match="loss_scale is defined for global batches"):
        sampler.loss_scale


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "either a per-rank batch_size or a global_batch_size"),
        ({"batch_size": 4, "global_batch_size": 8}, "either a per-rank batch_size or a global_batch_size"),
        ({"batch_size": 4, "micro_batch_size": 2}, "micro_batch_size needs global_batch_size"),
        ({"global_batch_size": 0}, "global_batch_size must be an integer >= 1"),
        ({"global_batch_size": 8, "micro_batch_size": 0}, "micro_batch_size must be an integer >= 1"),
        ({"global_batch_size": 8.0}, "global_batch_size must be an integer"),
    ],
)
def test_bad_arguments_give_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ElasticSampler(10).batches(**kwargs)


class SyncRecorder:
    """A stand-in for DDP that records whether each micro-batch ran under no_sync()."""

    def __init__(self):
        self.syncing = True

    @contextlib.contextmanager
    def no_sync(self):
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True


def test_accumulate_runs_all_but_the_last_micro_batch_under_no_sync():
    model = SyncRecorder()
    seen = [(rows, model.syncing) for rows in elastic.accumulate(model, [[1, 2], [3], [4]])]
    assert seen == [([1, 2], False), ([3], False), ([4], True)]
    assert [model.syncing for _ in elastic.accumulate(model, [[5]])] == [True]
    assert list(elastic.accumulate(model, [])) == []
    for _ in elastic.accumulate(model, [[1], [2]]):
        break  # leaving the loop early leaves no_sync too
    assert model.syncing
    assert list(elastic.accumulate(torch.nn.Linear(1, 1), [[1], [2]])) == [[1], [2]]  # no DDP: plain
