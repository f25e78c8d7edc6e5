"""The global order, the batches, the shares and the cursor: pure functions, as tables."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic.data.order import (EpochOrder, OrderSettings, batch_bounds, cursor_after, keyed_permutation, locate,
                                rank_share, resume_cursor, shard_order, shuffle_key, steps_left)


def test_the_shuffles_are_pinned_across_library_versions():
    # A resume in a later run (another numpy, another torch) must see the same order:
    # these values are the contract, not an accident of a generator's stream.
    assert keyed_permutation(8, shuffle_key(0, 0, 0)).tolist() == [6, 0, 3, 4, 5, 7, 1, 2]
    assert shard_order(6, OrderSettings(seed=0), 0) == [0, 5, 4, 2, 3, 1]
    assert shard_order(6, OrderSettings(seed=0), 1) == [2, 1, 3, 0, 4, 5]
    assert shard_order(6, OrderSettings(seed=1), 0) == [2, 1, 5, 0, 3, 4]


@pytest.mark.parametrize("counts, settings_, epoch, shards, ids", [
    # no shuffle: the shards front to back
    ([3, 0, 4, 2], OrderSettings(shuffle=False), 0, [0, 1, 2, 3], list(range(9))),
    # window 1: the shards shuffled, each read front to back (empty shard 1 reads nothing)
    ([3, 0, 4, 2], OrderSettings(seed=0, window=1), 0, [0, 2, 3, 1], [0, 1, 2, 3, 4, 5, 6, 7, 8]),
    # window 4: positions 0-3, 4-7, 8 shuffled among themselves, across shard ends
    ([3, 0, 4, 2], OrderSettings(seed=0, window=4), 0, [0, 2, 3, 1], [0, 3, 1, 2, 6, 7, 4, 5, 8]),
])
def test_epoch_order(counts, settings_, epoch, shards, ids):
    order = EpochOrder(counts, settings_, epoch)
    assert order.shards == shards
    assert order.ids(0, order.total).tolist() == ids
    assert order.ids(2, 7).tolist() == ids[2:7]  # any range reads the same positions


@pytest.mark.parametrize("counts, sample_id, where", [
    ([3, 0, 4, 2], 0, (0, 0)), ([3, 0, 4, 2], 2, (0, 2)), ([3, 0, 4, 2], 3, (2, 0)),
    ([3, 0, 4, 2], 8, (3, 1)), ([0, 0, 5], 4, (2, 4)),
])
def test_locate(counts, sample_id, where):
    assert locate(counts, sample_id) == where


def test_locate_refuses_an_id_outside_the_data():
    with pytest.raises(IndexError, match=r"sample id 9 is outside \[0, 9\)"):
        locate([3, 0, 4, 2], 9)


@pytest.mark.parametrize("cursor, total, g, drop_last, bounds, left, after", [
    (0, 10, 4, False, (0, 4), 3, 4),
    (8, 10, 4, False, (8, 10), 1, 10),     # the last, smaller batch
    (8, 10, 4, True, None, 0, 8),          # ... dropped
    (10, 10, 4, False, None, 0, 10),       # the epoch is complete
    (3, 10, 4, False, (3, 7), 2, 7),       # a cursor need not be a multiple of G (set by a commit)
])
def test_batches_and_the_cursor(cursor, total, g, drop_last, bounds, left, after):
    assert batch_bounds(cursor, total, g, drop_last) == bounds
    assert steps_left(cursor, total, g, drop_last) == left
    assert cursor_after(cursor, total, g, drop_last) == after


@pytest.mark.parametrize("start, end, world, rank, share", [
    (0, 8, 4, 0, [0, 4]), (0, 8, 4, 3, [3, 7]),
    (0, 8, 3, 0, [0, 3, 6]), (0, 8, 3, 2, [2, 5]),   # 3 does not divide 8: 3, 3, 2
    (8, 10, 4, 1, [9]), (8, 10, 4, 2, []),           # a short last batch: ranks 2, 3 get nothing
])
def test_rank_share(start, end, world, rank, share):
    assert list(rank_share(start, end, world, rank)) == share


@pytest.mark.parametrize("committed, trained_since, rolled_back, cursor", [
    (48, 2, True, 48),    # a failure: the two steps since the commit are trained again
    (48, 0, True, 48),
    (48, 0, False, 48),   # a switch (a join, a leave) happens at a commit
])
def test_the_cursor_after_a_re_formation_is_the_commits_at_any_world(committed, trained_since, rolled_back, cursor):
    assert resume_cursor(committed, trained_since, rolled_back) == cursor


def test_a_switch_with_steps_after_the_commit_is_a_bug():
    with pytest.raises(ValueError, match="a switch happens at a commit"):
        resume_cursor(48, 1, rolled_back=False)


def test_window_must_be_positive():
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        OrderSettings(window=0)


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(0, 30), min_size=1, max_size=8), seed=st.integers(0, 2**31),
       epoch=st.integers(0, 5), window=st.integers(1, 40), shuffle=st.booleans())
def test_an_epoch_is_a_permutation_and_windows_stay_local(counts, seed, epoch, window, shuffle):
    order = EpochOrder(counts, OrderSettings(seed, shuffle, window), epoch)
    ids = order.ids(0, order.total)
    assert sorted(ids.tolist()) == list(range(sum(counts)))
    # Window w holds exactly the samples at positions [w*window, (w+1)*window) of the
    # shards read in the epoch's order: a reader touches few shards at a time.
    unshuffled = EpochOrder(counts, OrderSettings(seed, shuffle, 1), epoch).ids(0, order.total)
    for start in range(0, order.total, window):
        assert sorted(ids[start:start + window].tolist()) == sorted(unshuffled[start:start + window].tolist())
    # Ranges read piecewise give the same ids.
    if order.total:
        cut = order.total // 2
        assert np.concatenate([order.ids(0, cut), order.ids(cut, order.total)]).tolist() == ids.tolist()


def test_epochs_differ_and_repeat():
    first = EpochOrder([50] * 4, OrderSettings(seed=3, window=64), 0).ids(0, 200).tolist()
    assert EpochOrder([50] * 4, OrderSettings(seed=3, window=64), 0).ids(0, 200).tolist() == first
    assert EpochOrder([50] * 4, OrderSettings(seed=3, window=64), 1).ids(0, 200).tolist() != first
