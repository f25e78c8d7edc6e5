"""The sync plan (elastic/worker/sync_plan.py): who holds the newest commit, who sends what."""

from __future__ import annotations

import itertools

import pytest

from elastic.worker.sync_plan import (ALIGN, ClaimBounds, CommitId, Holding, choose_holders, implausible_claim,
                                       plan_sync, stripes)


def holdings(*commits):
    return [Holding(rank, None if c is None else CommitId(*c)) for rank, c in enumerate(commits)]


def test_survivors_that_all_hold_the_newest_commit_move_nothing():
    plan = plan_sync(holdings((3, 10), (3, 10), (3, 10)), [(1000, 4)], 1 << 20)
    assert plan.holders == (0, 1, 2) and plan.receivers == () and plan.transfers == ()


def test_a_worker_one_commit_behind_receives_from_every_holder():
    plan = plan_sync(holdings((3, 11), (3, 10), (3, 11), (3, 11)), [(3000, 4)], 1 << 20)
    assert plan.newest == CommitId(3, 11)
    assert plan.holders == (0, 2, 3) and plan.receivers == (1,)
    assert {t.holder for t in plan.transfers} == {0, 2, 3}
    assert all(t.receiver == 1 for t in plan.transfers)


def test_a_later_round_wins_over_a_higher_count_from_an_older_history():
    # Rank 2 made commit 12 in round 4, was cut off; the ring rolled back to 11 and made
    # its own commit 12 in round 5. Counts alone would tie; the older history must lose.
    newest, holders, receivers = choose_holders(holdings((5, 12), (5, 12), (4, 12)))
    assert newest == CommitId(5, 12) and holders == (0, 1) and receivers == (2,)
    newest, holders, _ = choose_holders(holdings((5, 12), (4, 13)))
    assert newest == CommitId(5, 12) and holders == (0,)


def test_joiners_and_workers_without_a_commit_receive():
    newest, holders, receivers = choose_holders(holdings((2, 7), None, (2, 7), None))
    assert newest == CommitId(2, 7) and holders == (0, 2) and receivers == (1, 3)


def test_when_nobody_holds_a_commit_the_lowest_rank_is_the_only_source():
    newest, holders, receivers = choose_holders(holdings(None, None, None))
    assert newest is None and holders == (0,) and receivers == (1, 2)


def test_one_report_per_rank():
    with pytest.raises(ValueError):
        choose_holders([Holding(0, None), Holding(0, None)])


def covered(plan, receiver, buffers):
    """Per buffer, the sorted (start, end) element ranges that ``receiver`` gets."""
    ranges = {i: [] for i in range(len(buffers))}
    for t in plan.receives(receiver):
        ranges[t.buffer].append((t.start, t.start + t.length))
    return {i: sorted(r) for i, r in ranges.items()}


@pytest.mark.parametrize("holder_count", [1, 2, 3, 5])
@pytest.mark.parametrize("buffers", [[(1000, 4)], [(65_536, 4), (10, 8), (7, 2), (0, 4), (100_001, 1)]])
@pytest.mark.parametrize("chunk", [4 * ALIGN, 4096, 1 << 20])
def test_every_receiver_gets_every_element_exactly_once(holder_count, buffers, chunk):
    commits = [(1, 5)] * holder_count + [None, (1, 4)]
    plan = plan_sync(holdings(*commits), buffers, chunk)
    for receiver in plan.receivers:
        for index, ranges in covered(plan, receiver, buffers).items():
            position = 0
            for start, end in ranges:  # contiguous, no overlap, no gap
                assert start == position and end > start
                position = end
            assert position == buffers[index][0]
    for t in plan.transfers:
        assert t.length * buffers[t.buffer][1] <= chunk


def test_stripes_are_balanced_across_holders():
    buffers = [(4_000_000, 4), (1000, 8)]
    plan = plan_sync(holdings((1, 1), (1, 1), (1, 1), (1, 1), None), buffers, 1 << 20)
    sent = {h: sum(t.length * buffers[t.buffer][1] for t in plan.sends(h)) for h in plan.holders}
    total = sum(n * size for n, size in buffers)
    assert sum(sent.values()) == total
    assert max(sent.values()) - min(sent.values()) <= 2 * ALIGN


def test_stripe_cuts_fall_between_elements():
    for parts, sizes in itertools.product([1, 2, 3, 7], [[12, 8, 64, 200], [4 * 999, 2 * 5, 8 * 3]]):
        pieces = stripes(sizes, parts)
        assert sum(end - start for part in pieces for _, start, end in part) == sum(sizes)
        for part in pieces:
            for index, start, end in part:
                assert start % ALIGN == 0 or start == 0
                assert end == sizes[index] or end % ALIGN == 0


def test_the_plan_is_the_same_on_every_rank():
    args = (holdings((2, 3), None, (2, 3), (2, 2)), [(123_457, 4), (99, 8)], 4096)
    assert plan_sync(*args) == plan_sync(*args)


def test_chunk_size_must_be_aligned():
    with pytest.raises(ValueError):
        plan_sync(holdings((1, 1), None), [(10, 4)], 100)


# -- what the ring's history allows a peer to claim (implausible_claim) -----------------

_SURVIVOR = ClaimBounds(current=6, previous=5, members=frozenset({0, 1, 2}), mine=CommitId(5, 40))


@pytest.mark.parametrize("claims, bounds, why", [
    # honest rings: survivors one commit apart, a joiner, an older history, a fresh start
    (((5, 40), (5, 41), (5, 40), None), _SURVIVOR, None),
    (((5, 40), (3, 90), None), _SURVIVOR, None),
    ((None, None), ClaimBounds(current=1), None),
    (((1, 0), None), ClaimBounds(current=1), None),  # committed before the first sync
    (((4, 12), (4, 12)), ClaimBounds(current=6, mine=CommitId(4, 12)), None),  # not a survivor of round 5
    # the review's attacker: a commit of a round that has not happened
    (((5, 40), None, None, (10 ** 6, 10 ** 6)), _SURVIVOR, "after the current round 6"),
    (((5, 40), None, None, (6, 1)), _SURVIVOR, None),  # the current round itself is not after it
    # a joiner claiming the previous ring's commit: it was not in that ring
    (((5, 40), None, None, (5, 41)), _SURVIVOR, "whose ring it was not in"),
    # a member of the previous ring far ahead of the others
    (((5, 40), (5, 10 ** 6)), _SURVIVOR, "more than one ahead"),
    (((5, 40), (-1, 3)), _SURVIVOR, "negative"),
])
def test_claims_the_rings_history_does_not_allow(claims, bounds, why):
    found = implausible_claim(holdings(*claims), bounds)
    assert (found is None) if why is None else (why in found), found
