"""Which commits of a round may be switch points (a join, a graceful leave, a stop).

At a switch point rank 0 decides whether the ring switches or stops, and every rank
takes its word in one broadcast of two int64s over the ring (``agree``, below): the
same commit on every rank, so the whole ring acts there together. Asked at every
commit, any such look costs (a store look per commit was the largest cost of a commit
after the copy of the state: 1.3-1.9 ms mean per commit, with 40 ms steps on 4 workers
sharing 2 cores).

So switch points are spaced: every ``every``-th commit from an ``origin`` commit.
A round starts with every commit a point. At each exchange of the straggler watch
(stragglers.py: one all_gather at the same commit everywhere, about every 2 s) all
ranks learn the same pace, and from that commit on the points are ``SPACING_S`` of
steps apart at that pace (at most ``MAX_EVERY`` commits). Both sides count points
alike, and every exchange comes at a point of the spacing before it (the watch rounds
its next exchange up to one), and the exchange's commit is a point of the new spacing
too, so the ranks never disagree on which commit is a point.

The cost: a switch comes up to ``SPACING_S`` later (a joiner starts training a
little later, a graceful leave takes a little longer); nothing is rolled back.
"""

from __future__ import annotations

from typing import Callable, Optional

from ..contract.errors import PeerDataInvalid

SPACING_S = 0.25  # seconds of steps between two switch points, at the agreed pace
MAX_EVERY = 16  # the most commits between two switch points


class SwitchPoints:
    """One round's schedule of switch points, alike on every rank."""

    def __init__(self, spacing_s: float = SPACING_S, max_every: int = MAX_EVERY):
        self.every, self.origin = 1, 0
        self._spacing_s, self._max_every = spacing_s, max_every

    def agree(self, commits: int, seconds_per_commit: float) -> int:
        """At ``commits`` (a point), every rank learned the same pace: space the points
        from there. Returns the spacing; the next exchange must come at a point."""
        if seconds_per_commit > 0:
            self.every = max(1, min(self._max_every, int(self._spacing_s / seconds_per_commit)))
            self.origin = commits
        return self.every

    def is_point(self, commits: int) -> bool:
        return commits >= self.origin and (commits - self.origin) % self.every == 0


# -- the decision agreed in the ring (security review 2, H4) -----------------------------
# The round's store is reachable by more than the ring, and a value read there that turns
# out malformed or unconfirmed is a ring failure, which spends every worker's
# --max-resets: a stranger who wrote "switch_at = x" ahead for the next rounds (their
# prefixes are predictable) ended the job with ResetLimitExceeded. So the decision does
# not travel through the store: at each switch point every rank joins one broadcast of two
# int64s from rank 0 (its decision, or none), over the ring's own connections, which only
# the plan's members hold. Nothing a stranger writes into the store is read for it, so
# nothing there can decide a switch or spend the budget.
#
# The broadcast is posted at a point and taken at the next one, where the whole ring acts
# on it: a commit never waits for its peers' commits. Taken at once, a commit at a point
# was a barrier: rank 0's commit returned only once every rank had reached its own, so a
# worker that died between rank 0's commit and its own hung the others' commits until the
# hang bound (tests/integration/test_kill_points.py), and every point cost the ranks' skew.
# The cost: a switch or a stop comes one point later (SPACING_S at most, or one commit at
# the start of a round); nothing is rolled back.
_NO_DECISION = 0
_CODES = {"switch": 1, "stop": 2}
_ACTIONS = {code: action for action, code in _CODES.items()}

Exchange = Callable[[list[int]], Callable[[], list[int]]]  # post rank 0's words; take them later


def decision_words(decided: Optional[tuple[int, str]]) -> list[int]:
    """What rank 0 posts at a point: [that commit, action code], or [-1, 0] for none."""
    if decided is None:
        return [-1, _NO_DECISION]
    commit, action = decided
    return [int(commit), _CODES[action]]


def read_decision(words: list[int], commits: int) -> Optional[str]:
    """The action rank 0 posted at an earlier point, taken at the point ``commits``; None
    for none. A decision from this point or a later one, or an unknown action, is
    impossible from a rank 0 that counts points as we do (PeerDataInvalid: the ring's own
    member said it, so it is a ring fault, not a stranger's word)."""
    commit, code = words
    if code == _NO_DECISION:
        return None
    if code not in _ACTIONS or not 0 <= commit < commits:
        raise PeerDataInvalid(f"rank 0's switch decision {words} is impossible at commit {commits}")
    return _ACTIONS[code]


def ring_exchange(words: list[int]) -> Callable[[], list[int]]:
    """Post rank 0's ``words`` to every rank, one asynchronous broadcast on the default
    process group (on the device the ring's wire uses: a host tensor for gloo, CUDA for
    NCCL alone); the callable returned waits for them. Every rank posts at the same commit,
    so the collectives keep one order on every rank."""
    import torch
    import torch.distributed as dist

    from ..contract.devices import capability

    tensor = torch.tensor(words, dtype=torch.int64, device=capability(str(dist.get_backend())).wire_device)
    work = dist.broadcast(tensor, src=0, async_op=True)

    def take() -> list[int]:
        work.wait()  # a broken ring raises here, like any collective
        return [int(v) for v in tensor.tolist()]
    return take
