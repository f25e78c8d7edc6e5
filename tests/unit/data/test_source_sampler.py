"""SourceSampler: each sample once per epoch through any resizes and rollbacks; settings refused."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic.data import SourceSampler
from elastic.data.order import EpochOrder, OrderSettings


class Ring:
    """One sampler per rank of a (re-)formed world, from a committed state, stepping together."""

    def __init__(self, counts, world, committed, **kwargs):
        self.samplers = []
        for rank in range(world):
            sampler = SourceSampler(counts, **kwargs)
            if committed is not None:
                sampler.load_state_dict(json.loads(json.dumps(committed)))  # as committed: plain data
            sampler.set_rank(rank, world)
            self.samplers.append(sampler)
        self.world = world
        self.start_pass()

    def start_pass(self):
        self.iterators = [iter(s) for s in self.samplers]
        self.lengths = {len(s) for s in self.samplers}
        self.batch_idx = 0

    def step(self):
        """One synchronous step: (epoch, the global batch), or None when the pass is over."""
        shares = [next(it, None) for it in self.iterators]
        if all(share is None for share in shares):
            return None
        assert all(share is not None for share in shares), "uneven step counts"
        size = sum(map(len, shares))
        assert {len(s) for s in shares} <= {size // self.world, -(-size // self.world)}
        assert {s.loss_scale for s in self.samplers} == {self.world / size}
        batch = [shares[i % self.world][i // self.world] for i in range(size)]  # shares are batch[r::W]
        for sampler in self.samplers:
            sampler.record_batch(self.batch_idx)
        self.batch_idx += 1
        return self.samplers[0].epoch, batch

    def next_epoch(self):
        for sampler in self.samplers:
            sampler.set_epoch(sampler.epoch + 1)
        self.start_pass()

    def state(self):
        states = [s.state_dict() for s in self.samplers]
        assert all(s == states[0] for s in states), "ranks disagree on the committed state"
        return states[0]


def run(counts, segments, **kwargs):
    """Each segment: (world, steps, commit_every, ends_in_failure). Returns the committed
    steps' batches in order, as (epoch, batch)."""
    committed, trained, pending = None, [], []
    for world, steps, commit_every, failure in segments:
        ring = Ring(counts, world, committed, **kwargs)
        for _ in range(steps):
            done = ring.step()
            if done is None:
                ring.next_epoch()
                done = ring.step()
                if done is None:  # an empty data set
                    break
            pending.append(done)
            if len(pending) % commit_every == 0:
                committed, trained, pending = ring.state(), trained + pending, []
        if failure:
            pending = []  # rolled back: the model forgot them, the cursor goes back
        else:
            committed, trained, pending = ring.state(), trained + pending, []  # a switch is a commit
    return trained


@settings(max_examples=80, deadline=None)
@given(counts=st.lists(st.integers(0, 25), min_size=1, max_size=6), g=st.integers(1, 17),
       drop_last=st.booleans(), window=st.integers(1, 50), seed=st.integers(0, 1000),
       segments=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 12), st.integers(1, 3), st.booleans()),
                         min_size=1, max_size=8))
def test_every_sample_once_per_epoch_across_resizes_and_rollbacks(counts, g, drop_last, window, seed, segments):
    kwargs = dict(global_batch_size=g, drop_last=drop_last, window=window, seed=seed)
    trained = run(counts, segments, **kwargs)
    total = sum(counts)
    # The same global batches as one process stepping through, whatever the worlds.
    alone = run(counts, [(1, len(trained), 1, False)], **kwargs)
    assert [(e, sorted(b)) for e, b in trained] == [(e, sorted(b)) for e, b in alone]
    by_epoch: dict[int, list[int]] = {}
    for epoch, batch in trained:
        by_epoch.setdefault(epoch, []).extend(batch)
    for epoch, seen in by_epoch.items():
        assert len(seen) == len(set(seen)), f"a sample trained twice in epoch {epoch}"
        order = EpochOrder(counts, OrderSettings(seed, True, window), epoch).ids(0, total).tolist()
        assert sorted(seen) == sorted(order[:len(seen)]), "the epoch's trained samples are a prefix of its order"
        if epoch != max(by_epoch):
            expected = total - (total % g if drop_last else 0)
            assert len(seen) == expected, f"epoch {epoch} missed samples"


def test_a_changed_setting_is_refused_in_one_line():
    sampler = SourceSampler([10, 10], global_batch_size=4, seed=0)
    state = sampler.state_dict()
    for change, named in [(dict(seed=1), "seed committed as 0, now 1"),
                          (dict(global_batch_size=8), "global_batch_size committed as 4, now 8"),
                          (dict(window=16), "window committed as 8192, now 16")]:
        other = SourceSampler([10, 10], **{"global_batch_size": 4, **change})
        with pytest.raises(ValueError, match=named) as refused:
            other.load_state_dict(state)
        assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match="samples committed as 20, now 21"):
        SourceSampler([10, 11], global_batch_size=4).load_state_dict(state)
    with pytest.raises(ValueError, match="index committed as"):  # same total, other shards
        SourceSampler([11, 9], global_batch_size=4).load_state_dict(state)


def test_the_state_is_one_cursor_and_the_settings():
    sampler = SourceSampler([100] * 10, global_batch_size=32)
    for step, _ in zip(range(3), sampler):
        sampler.record_batch(step)
    assert sampler.state_dict() == {"epoch": 0, "cursor": 96, "seed": 0, "shuffle": True, "window": 8192,
                                    "global_batch_size": 32, "drop_last": False, "samples": 1000,
                                    "index": sampler.index_digest}
    assert sampler.processed_count == 96 and sampler.remaining_count == 904


def test_recording_a_batch_ahead_of_the_cursor_is_refused():
    sampler = SourceSampler([20], global_batch_size=4)
    iter(sampler)
    with pytest.raises(ValueError, match=r"record_batch\(2\) before the batches of the pass ahead of it"):
        sampler.record_batch(2)
    sampler.record_batch(0)
    sampler.record_batch(0)  # again: nothing more is consumed
    assert sampler.cursor == 4


def test_an_epoch_ends_until_set_epoch_and_set_epoch_keeps_the_current_epoch(caplog):
    sampler = SourceSampler([5], global_batch_size=2)
    for step, _ in enumerate(sampler):
        sampler.record_batch(step)
    assert sampler.cursor == 5 and list(sampler) == []
    assert "epoch 0 is complete" in caplog.text
    sampler.set_epoch(0)
    assert sampler.cursor == 5
    sampler.set_epoch(1)
    assert sampler.cursor == 0 and len(sampler) == 3
