"""The re-shard plan and the replica placement as tables: no processes."""

from __future__ import annotations

import itertools

import pytest
import torch

from elastic.sharded.placement import replica_holders, replicas_of
from elastic.sharded.reshard_plan import TensorLayout, bytes_moved, newest_covered, plan_reshard, shard_rows
from elastic.worker.sync_plan import CommitId


@pytest.mark.parametrize("rows, world, expected", [
    (10, 3, [(0, 4), (4, 8), (8, 10)]),
    (7, 4, [(0, 2), (2, 4), (4, 6), (6, 7)]),
    (13, 2, [(0, 7), (7, 13)]),
    (2, 4, [(0, 1), (1, 2), (2, 2), (2, 2)]),  # torch.chunk gives 2 chunks: the last ranks hold nothing
    (5, 4, [(0, 2), (2, 4), (4, 5), (5, 5)]),
    (0, 3, [(0, 0), (0, 0), (0, 0)]),
])
def test_shard_rows_follow_torch_chunk(rows, world, expected):
    assert [shard_rows(rows, world, s) for s in range(world)] == expected
    chunks = torch.arange(rows).chunk(world) if rows else []
    for shard, (start, end) in enumerate(expected):
        got = chunks[shard].tolist() if shard < len(chunks) else []
        assert got == list(range(start, end))


def _apply(layout, old_world, holders, new_world, pieces):
    """Run the plan on real tensors: each holder's copy of each old shard, into new shards."""
    full = {t.key: torch.arange(t.rows * t.row_elements, dtype=torch.float64).reshape(t.shape) for t in layout}
    old = {(t.key, s): full[t.key][slice(*shard_rows(t.rows, old_world, s))].reshape(-1)
           for t in layout for s in range(old_world)}
    new = {(t.key, r): torch.full((t.shard_elements(new_world, r),), -1.0) for t in layout for r in range(new_world)}
    for p in pieces:
        assert p.holder in holders[p.shard]
        source = old[p.key, p.shard][p.src_start:p.src_start + p.length]
        new[p.key, p.receiver][p.dst_start:p.dst_start + p.length] = source
    for t in layout:
        for r in range(new_world):
            assert torch.equal(new[t.key, r], full[t.key][slice(*shard_rows(t.rows, new_world, r))].reshape(-1))


LAYOUT = (TensorLayout("w7", (7, 3), "float64"), TensorLayout("b10", (10,), "float64"),
          TensorLayout("w13", (13, 10), "float32"), TensorLayout("tiny", (2, 5), "float64"))


@pytest.mark.parametrize("old_world, new_world", list(itertools.product([1, 2, 3, 4], [1, 2, 3, 4])))
def test_every_rank_gets_exactly_its_new_rows(old_world, new_world):
    # Old shard s held by new rank s % new_world and by a replica on the next one.
    holders = {s: sorted({s % new_world, (s + 1) % new_world}) for s in range(old_world)}
    pieces = plan_reshard(LAYOUT, old_world, holders, new_world)
    _apply(LAYOUT, old_world, holders, new_world, pieces)
    # Each element of a new shard arrives exactly once.
    for t in LAYOUT:
        for r in range(new_world):
            mine = sorted((p.dst_start, p.length) for p in pieces if p.key == t.key and p.receiver == r)
            position = 0
            for start, length in mine:
                assert start == position and length > 0
                position += length
            assert position == t.shard_elements(new_world, r)


@pytest.mark.parametrize("old_world, holders, new_world, moved_elements", [
    # Same world, every rank holds its own old shard: all local, nothing crosses the network.
    (3, {0: [0], 1: [1], 2: [2]}, 3, 0),
    # 4 -> 3 after rank 3 died: its shard comes from its replica on rank 0.
    (4, {0: [0], 1: [1], 2: [2], 3: [0]}, 3, None),
    # Striping: a shard held twice is split between both holders.
    (1, {0: [0, 1]}, 2, None),
])
def test_local_copies_and_striping(old_world, holders, new_world, moved_elements):
    pieces = plan_reshard(LAYOUT, old_world, holders, new_world)
    _apply(LAYOUT, old_world, holders, new_world, pieces)
    sizes = {t.key: 8 for t in LAYOUT}
    if moved_elements is not None:
        assert bytes_moved(pieces, sizes) == moved_elements
    for p in pieces:  # a receiver that holds the old shard never takes it from elsewhere
        if p.receiver in holders[p.shard]:
            assert p.holder == p.receiver


def test_a_range_held_twice_is_striped_across_both_holders():
    layout = (TensorLayout("w", (10, 4), "float64"),)
    pieces = plan_reshard(layout, 1, {0: [0, 1]}, 3)
    to_two = [p for p in pieces if p.receiver == 2]
    assert sorted((p.holder, p.src_start, p.length) for p in to_two) == [(0, 32, 4), (1, 36, 4)]


def test_a_shard_held_by_nobody_is_refused():
    with pytest.raises(ValueError, match=r"\[1\]"):
        plan_reshard(LAYOUT, 2, {0: [0]}, 2)


C = CommitId


@pytest.mark.parametrize("held, worlds, expected", [
    # Every shard of commit 5 held: 5; commit 6 misses shard 2 (its owner died before replicating).
    ({0: [(C(1, 6), 0), (C(1, 5), 0), (C(1, 5), 2)], 1: [(C(1, 6), 1), (C(1, 5), 1)]},
     {C(1, 6): 3, C(1, 5): 3}, C(1, 5)),
    # Commit 6 fully held through replicas.
    ({0: [(C(1, 6), 0), (C(1, 6), 2)], 1: [(C(1, 6), 1)]}, {C(1, 6): 3}, C(1, 6)),
    # A later round's commit wins over a larger count of an earlier round.
    ({0: [(C(2, 4), 0)], 1: [(C(1, 9), 0)]}, {C(2, 4): 1, C(1, 9): 1}, C(2, 4)),
    # Every copy of shard 1 lost: nothing.
    ({0: [(C(1, 6), 0)]}, {C(1, 6): 2}, None),
    ({}, {}, None),
])
def test_newest_covered(held, worlds, expected):
    assert newest_covered(held, worlds) == expected


@pytest.mark.parametrize("members, replicas, expected", [
    # Two hosts of two: each copy on the other host, spread evenly.
    (["a", "a", "b", "b"], 1, ((2,), (3,), (0,), (1,))),
    # One host: the next rank around the ring.
    (["a", "a", "a"], 1, ((1,), (2,), (0,))),
    # Three hosts, two replicas: both on other hosts, never two on the same one.
    (["a", "b", "c"], 2, ((1, 2), (0, 2), (0, 1))),
    # Two hosts but two replicas asked: the second falls back to the same host.
    (["a", "a", "b", "b"], 2, ((2, 1), (3, 0), (0, 3), (1, 2))),
    # No replicas.
    (["a", "b"], 0, ((), ())),
    # More replicas than other workers: as many as there are.
    (["a", "b"], 3, ((1,), (0,))),
])
def test_replica_placement(members, replicas, expected):
    holders = replica_holders(members, replicas)
    assert holders == expected
    for rank, mine in enumerate(holders):
        assert rank not in mine


def test_losing_any_one_host_keeps_a_copy_of_every_shard():
    members = ["a", "a", "b", "b", "c", "c"]
    holders = replica_holders(members, 1)
    for lost in "abc":
        for rank, mine in enumerate(holders):
            survivors = [r for r in (rank, *mine) if members[r] != lost]
            assert survivors, (lost, rank)
    assert replicas_of(holders, 0) == tuple(o for o, m in enumerate(holders) if 0 in m)
    assert sorted(len(replicas_of(holders, r)) for r in range(6)) == [1] * 6


def test_negative_replicas_are_refused():
    with pytest.raises(ValueError, match="--shard-replicas"):
        replica_holders(["a"], -1)
