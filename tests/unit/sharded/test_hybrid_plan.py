"""The hybrid mesh's decisions as tables: which groups go on, who waits as a spare, who
sends which slot to a refilled group, and each replica's share of a constant global batch."""

from __future__ import annotations

import pytest
import torch

from elastic.sharded.hybrid_plan import (FLAT, HYBRID, NONE, HybridShape, SlotPiece, data_share, plan_mesh,
                                         plan_refill, replica_rows)
from elastic.sharded.reshard_plan import TensorLayout, plan_reshard, shard_rows

S2 = HybridShape(2)


def _ring(spec: str):
    """'a0 a1 b0 b1' -> workers and hosts (the letter is the host)."""
    workers = spec.split()
    return workers, [w[0] for w in workers]


def _groups(spec: str) -> dict:
    """'a0,a1 b0,b1' -> each worker's previous group."""
    out = {}
    for group in spec.split():
        members = tuple(group.split(","))
        for w in members:
            out[w] = members
    return out


@pytest.mark.parametrize("ring, previous, shape, mode, groups, spares, kept", [
    # A fresh 2 x 2: one group per host.
    ("a0 a1 b0 b1", "", S2, HYBRID, [[0, 1], [2, 3]], [], []),
    # 2 x 2, b1 killed: one complete group is fewer than min_groups=2: the 1-D path.
    ("a0 a1 b0", "a0,a1 b0,b1", S2, FLAT, [], [], []),
    # ... with min_groups=1 the complete group goes on and b0 waits.
    ("a0 a1 b0", "a0,a1 b0,b1", HybridShape(2, min_groups=1), HYBRID, [[0, 1]], [2], [0]),
    # 3 x 2, b1 killed: a and c go on unchanged, b0 is a spare.
    ("a0 a1 b0 c0 c1", "a0,a1 b0,b1 c0,c1", S2, HYBRID, [[0, 1], [3, 4]], [2], [0, 1]),
    # 3 x 2, host b lost: a and c go on, nobody waits.
    ("a0 a1 c0 c1", "a0,a1 b0,b1 c0,c1", S2, HYBRID, [[0, 1], [2, 3]], [], [0, 1]),
    # The replacement b2 joins (appended): the spare and it are a new group.
    ("a0 a1 b0 c0 c1 b2", "a0,a1 b0,b1 c0,c1", S2, HYBRID, [[0, 1], [2, 5], [3, 4]], [], [0, 2]),
    # A new host d joins a 2 x 2: a third group.
    ("a0 a1 b0 b1 d0 d1", "a0,a1 b0,b1", S2, HYBRID, [[0, 1], [2, 3], [4, 5]], [], [0, 1]),
    # After a flat round nobody has a group: cut per host again.
    ("a0 a1 b0 b2", "", S2, HYBRID, [[0, 1], [2, 3]], [], []),
    # A host of 3 workers with groups of 2: one worker left over waits.
    ("a0 a1 a2 b0 b1", "", S2, HYBRID, [[0, 1], [3, 4]], [2], []),
    # Survivors keep their group even when ranks move (a0 died before; order a1 b0 b1 a2 ...).
    ("b0 b1 a1 a2", "b0,b1 a1,a2", S2, HYBRID, [[0, 1], [2, 3]], [], [0, 1]),
    # A group's coordinates are its old order, not the new rank order.
    ("a1 a0 b0 b1", "a0,a1 b0,b1", S2, HYBRID, [[1, 0], [2, 3]], [], [0, 1]),
    # Tensor parallel inside the group (shard 1 x tp 2): a host lost, the other group goes on
    # (a tensor-parallel group cannot take the 1-D path) ...
    ("a0 a1", "a0,a1 b0,b1", HybridShape(1, 2), HYBRID, [[0, 1]], [], [0]),
    # ... and with no complete group nothing can train.
    ("a0 b0", "a0,a1 b0,b1", HybridShape(1, 2), NONE, [], [0, 1], []),
])
def test_plan_mesh(ring, previous, shape, mode, groups, spares, kept):
    workers, hosts = _ring(ring)
    plan = plan_mesh(workers, hosts, _groups(previous), shape)
    assert plan.mode == mode
    assert [list(g) for g in plan.groups] == groups
    assert list(plan.spares) == spares
    if mode == HYBRID:
        assert [list(plan.groups[i]) for i in plan.kept] == [groups[i] for i in kept]
        trained = sorted(r for g in groups for r in g)
        assert sorted(trained + spares) == list(range(len(workers)))
        for g in plan.groups:
            assert len({hosts[r] for r in g}) == 1  # a group never spans hosts


def test_plan_mesh_refuses_duplicates():
    with pytest.raises(ValueError):
        plan_mesh(["a0", "a0"], ["a", "a"], {}, S2)


def test_a_kept_group_keeps_its_coordinates():
    plan = plan_mesh(["a1", "a0", "b0", "b1"], list("aabb"), _groups("a0,a1 b0,b1"), S2)
    assert plan.groups[0] == (1, 0)  # a0 is still coordinate 0: it holds shard 0
    assert plan.place(0) == (0, 1) and plan.place(1) == (0, 0)


@pytest.mark.parametrize("ring, previous, shape, batch, shares, rows", [
    # 2 x 2: four data ranks of 12 rows.
    ("a0 a1 b0 b1", "", S2, 12, {0: (0, 4), 1: (1, 4), 2: (2, 4), 3: (3, 4)}, [6, 6]),
    # 3 x 2 with a spare: the two groups take the lost group's rows; the spare takes none.
    ("a0 a1 b0 c0 c1", "a0,a1 b0,b1 c0,c1", S2, 12, {0: (0, 4), 1: (1, 4), 2: None, 3: (2, 4), 4: (3, 4)},
     [6, 6]),
    # Uneven: 13 rows over 3 groups of 2.
    ("a0 a1 b0 b1 c0 c1", "", S2, 13, {r: (r, 6) for r in range(6)}, [5, 4, 4]),
    # The flat fallback: every rank is a data rank.
    ("a0 a1 b0", "a0,a1 b0,b1", S2, 12, {0: (0, 3), 1: (1, 3), 2: (2, 3)}, [12]),
    # Tensor parallel: the two tp peers of a group share one share.
    ("a0 a1 b0 b1", "", HybridShape(1, 2), 12, {0: (0, 2), 1: (0, 2), 2: (1, 2), 3: (1, 2)}, [6, 6]),
])
def test_data_share_keeps_the_global_batch(ring, previous, shape, batch, shares, rows):
    workers, hosts = _ring(ring)
    plan = plan_mesh(workers, hosts, _groups(previous), shape)
    assert {r: data_share(plan, r) for r in range(len(workers))} == shares
    assert replica_rows(batch, plan) == rows
    assert sum(rows) == batch
    seen = sorted(i for share in {s for s in shares.values() if s} for i in range(share[0], batch, share[1]))
    assert seen == list(range(batch))  # every row of the global batch, once


@pytest.mark.parametrize("needs, holders, sizes, expected", [
    # Every worker holds its own coordinate: nothing moves.
    ({0: 0, 1: 1, 2: 0, 3: 1}, {0: [0, 2], 1: [1, 3]}, {0: {"float64": 8}, 1: {"float64": 6}}, []),
    # Group (4, 5) is new: its slots come from both healthy replicas, striped.
    ({0: 0, 1: 1, 2: 0, 3: 1, 4: 0, 5: 1}, {0: [0, 2], 1: [1, 3]}, {0: {"float64": 8}, 1: {"float64": 7}},
     [SlotPiece(0, 0, 4, "float64", 0, 4), SlotPiece(0, 2, 4, "float64", 4, 4),
      SlotPiece(1, 1, 5, "float64", 0, 3), SlotPiece(1, 3, 5, "float64", 3, 4)]),
    # One healthy replica, two dtypes; a spare holding an older commit is no holder.
    ({0: 0, 1: 1, 2: 0, 3: 1}, {0: [0], 1: [1]}, {0: {"float32": 2, "float64": 3}, 1: {"float32": 2, "float64": 0}},
     [SlotPiece(0, 0, 2, "float32", 0, 2), SlotPiece(0, 0, 2, "float64", 0, 3),
      SlotPiece(1, 1, 3, "float32", 0, 2)]),
])
def test_plan_refill(needs, holders, sizes, expected):
    pieces = plan_refill(needs, holders, sizes)
    assert pieces == expected
    for receiver, coordinate in needs.items():  # every element of every needed slot arrives once
        if receiver in holders[coordinate]:
            continue
        for dtype, total in sizes[coordinate].items():
            got = sorted((p.start, p.length) for p in pieces if p.receiver == receiver and p.dtype == dtype)
            position = 0
            for start, length in got:
                assert start == position
                position += length
            assert position == total


def test_plan_refill_refuses_an_unheld_slot():
    with pytest.raises(ValueError, match="held by nobody"):
        plan_refill({0: 0, 1: 1}, {0: [0]}, {0: {"float64": 1}, 1: {"float64": 1}})


LAYOUT = (TensorLayout("w", (7, 3), "float64"), TensorLayout("b", (10,), "float64"))


@pytest.mark.parametrize("old_world, groups", [(1, [[0, 1], [2, 3]]), (3, [[0, 1], [2, 3]]), (2, [[1, 0], [3, 2]])])
def test_plan_reshard_into_groups(old_world, groups):
    """From a flat commit (or rank 0's whole model) into groups: each group's receivers get
    FSDP2's dim-0 shard of its coordinate, from a holder."""
    holders = {s: [s] for s in range(old_world)}
    full = {t.key: torch.arange(t.rows * t.row_elements, dtype=torch.float64) for t in LAYOUT}
    old = {(t.key, s): full[t.key].view(t.shape)[slice(*shard_rows(t.rows, old_world, s))].reshape(-1)
           for t in LAYOUT for s in range(old_world)}
    for members in groups:
        pieces = plan_reshard(LAYOUT, old_world, holders, len(members), receivers=members)
        for coordinate, receiver in enumerate(members):
            for t in LAYOUT:
                new = torch.full((t.shard_elements(len(members), coordinate),), -1.0)
                for p in pieces:
                    if p.receiver == receiver and p.key == t.key:
                        new[p.dst_start:p.dst_start + p.length] = old[t.key, p.shard][p.src_start:p.src_start + p.length]
                expected = full[t.key].view(t.shape)[slice(*shard_rows(t.rows, len(members), coordinate))].reshape(-1)
                assert torch.equal(new, expected)
        for p in pieces:  # a receiver that holds the old shard copies it locally
            assert p.holder == p.receiver or p.receiver not in holders[p.shard]
