"""Who is cut off from the ring? Reachability reports in, members to exclude out.

A host that reaches etcd but not its peers keeps its lease: nothing evicts it by
TTL, and every worker of the ring blocks in a collective that can never finish.
So when an agent sees its workers stalled, it probes its peers' agents (a TCP
connect to their store port, answered by the agent process, not by the blocked
workers) and writes what it could not reach under ``reach/<member-id>``, on its
lease (``elastic/agent/peer_probe.py``). Only "cannot connect" (no answer within
the probe timeout, twice in a row) is reported: a refusal is an answer, and a slow
or busy host is still reachable, so a long step never gets anybody excluded.

``exclusions`` is the coordinator's pure decision over those reports:

* **Inside the ring** (members of the current plan, reports made in its round):
  a pair of members is *broken* when either reports the other unreachable (gloo
  needs a connection between every pair). While a pair is broken, the member
  with the most broken pairs goes; among equals, one that has not reported (a
  reporter evidently reaches etcd and is alive; a silent member may be cut off
  from everything, and a ring that kept it could not form until its lease ran
  out), then the one whose first rank is highest, so rank 0's host (the round's
  store) stays when nothing else tells them apart. What is
  left reaches itself entirely. If that is fewer than half of the ring, nobody
  is excluded: a network this broken is no single host's fault, and gloo's
  collective timeout and the reset path deal with it. Until every member of the
  ring has reported (within ``grace`` of the first report of a broken pair), the
  decision waits up to ``grace`` seconds after that report, so that one early
  report does not pick the wrong side; unless no report still missing could change
  it: when every pair of each silent member is broken already, its report can add
  no broken pair, and if the decision is the same whichever of them report (they
  only tip ties), it is made at once. A host whose link was cut can report nothing,
  so that is what spares a dead host's loss the whole grace (issue 41).
* **Outside the ring** (registered members without a rank: one excluded earlier,
  or a joiner): kept out while its own newest report names a kept member of the
  ring, or a kept member's newest report names it. An excluded host's agent keeps
  probing, and so do the agents that could not reach it: once every report
  between them is clean again, it is admitted at the next commit like any joiner.

Everything here is data in, data out; the table tests are in
tests/unit/test_reachability.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from .errors import parsing, texts
from .rounds import RoundPlan

# Seconds the coordinator waits for the other members' reports once a broken pair
# is reported, before it decides with what it has.
REPORT_GRACE_S = 1.0


@dataclass(frozen=True)
class ReachReport:
    """What one member's agent could not reach, probing during round ``round``."""

    member_id: str
    round: int
    unreachable: tuple[str, ...] = ()
    seen_at: float = 0.0  # coordinator's monotonic time of arrival (not serialized)

    def to_json(self) -> bytes:
        return json.dumps({"round": self.round, "unreachable": list(self.unreachable)}).encode()

    @classmethod
    def from_json(cls, member_id: str, data: bytes, seen_at: float = 0.0) -> "ReachReport":
        with parsing(f"reachability report of {member_id[:80]}"):
            obj = json.loads(data)
            return cls(member_id, int(obj["round"]), texts(obj.get("unreachable", []), "unreachable"), seen_at)


@dataclass(frozen=True)
class Exclusion:
    members: frozenset = frozenset()  # member ids to plan without
    recheck_at: Optional[float] = None  # decide again then (reports still awaited)
    reason: str = ""


def exclusions(
    plan: Optional[RoundPlan],
    registered: Sequence[str],
    reports: Mapping[str, ReachReport],
    now: float,
    grace: float = REPORT_GRACE_S,
) -> Exclusion:
    """The members to leave out of the next round (see the module docstring)."""
    if plan is None or not reports:
        return Exclusion()
    ring = plan.member_order()
    in_ring = set(ring)
    fresh = {m: r for m, r in reports.items() if m in in_ring and r.round == plan.round}
    broken = _broken_pairs(ring, fresh)
    out: set = set()
    recheck = None
    reason = ""
    if broken:
        first = min(fresh[m].seen_at for m in fresh if fresh[m].unreachable)
        # A clean report from an earlier stall of this round says nothing about now.
        recent = [m for m, r in fresh.items() if r.seen_at >= first - grace]
        if len(recent) < len(ring) and now < first + grace and not _settled(ring, broken, set(recent)):
            recheck = first + grace
        else:
            cut = _cut(ring, broken, reported=set(recent))
            if len(ring) - len(cut) >= len(ring) / 2:
                out |= cut
                reason = f"{', '.join(sorted(cut))} unreachable from the rest of round {plan.round}"
            else:
                reason = f"round {plan.round}: no half of the ring reaches itself; nobody excluded"
    kept = in_ring - out
    for member in registered:
        if member in in_ring:
            continue
        own = reports.get(member)
        blames = own is not None and kept & set(own.unreachable)
        blamed = any(member in reports[k].unreachable for k in kept if k in reports)
        if blames or blamed:
            out.add(member)
    return Exclusion(frozenset(out), recheck, reason)


def _broken_pairs(ring: Sequence[str], fresh: Mapping[str, ReachReport]) -> set:
    members = set(ring)
    pairs = set()
    for member, report in fresh.items():
        for other in report.unreachable:
            if other in members and other != member:
                pairs.add(frozenset((member, other)))
    return pairs


# Past this many silent members, whether their reports could matter is not worked out
# (2^n cuts): the decision waits for them, or the grace, as before.
_SETTLE_MAX_SILENT = 3


def _settled(ring: Sequence[str], broken: set, reported: set) -> bool:
    """Would the reports still missing leave the decision as it is? Only if each silent
    member's every pair is broken already (its report could add no broken pair) and the
    cut is the same whichever of them report (the reported set only breaks ties)."""
    silent = [m for m in ring if m not in reported]
    if not silent or len(silent) > _SETTLE_MAX_SILENT:
        return not silent
    if any(frozenset((m, other)) not in broken for m in silent for other in ring if other != m):
        return False
    now = _cut(ring, broken, reported)
    subsets = [{m for i, m in enumerate(silent) if bits >> i & 1} for bits in range(1, 1 << len(silent))]
    return all(_cut(ring, broken, reported | extra) == now for extra in subsets)


def _cut(ring: Sequence[str], broken: set, reported: set) -> set:
    """Greedy: drop the member in most broken pairs (among equals one that has not
    reported, then the later rank) until no broken pair is left."""
    order = {m: i for i, m in enumerate(ring)}
    pairs = set(broken)
    cut = set()
    while pairs:
        count: dict = {}
        for pair in pairs:
            for member in pair:
                count[member] = count.get(member, 0) + 1
        worst = max(count, key=lambda m: (count[m], m not in reported, order[m]))
        cut.add(worst)
        pairs = {p for p in pairs if worst not in p}
    return cut


def cut_off_from_its_ring(plan: Optional[RoundPlan], member: str, reports: Mapping[str, ReachReport]) -> bool:
    """Has every other member of ``plan``'s ring reported ``member`` unreachable in that
    round, while ``member`` reported nothing of it?

    This is the evidence a survivor takes to depose a coordinator whose host died hard
    (succession.py): it answers no connect, and its lease outlives it by a TTL. A
    coordinator that is alive and reaches etcd stalls with its ring and reports too, and
    then decides for itself (``exclusions``). Two other members at least: with one, its
    report and the coordinator's own decision could race to opposite answers.
    """
    if plan is None:
        return False
    ring = plan.member_order()
    others = [m for m in ring if m != member]
    if member not in ring or len(others) < 2:
        return False
    own = reports.get(member)
    if own is not None and own.round == plan.round:
        return False
    return all((r := reports.get(m)) is not None and r.round == plan.round and member in r.unreachable
               for m in others)
