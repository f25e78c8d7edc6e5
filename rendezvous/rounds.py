"""Rounds: the plan data model and the pure decider that says when a round closes.

``decide(view, settings, now)`` looks at what the coordinator knows (the
current plan, the registered members, reset requests) and returns what to do
next. It does no I/O and reads no clock, so it is tested as tables without etcd;
the coordinator applies its decision with a compare-and-set transaction.

Ranks are given to *workers* (processes). A member is one host agent that offers
some workers. Rank order is stable: survivors of the previous plan keep their
relative order (so rank 0 is always the longest-lived survivor, which holds the
newest committed state), newcomers are appended in the order their members
joined, and workers beyond ``max_np`` wait as spares.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional, Union

from .errors import ConfigError, parsing, text, texts
from .keys import JOB_LEASE_S


# The hold when newcomers start warm (elastic/worker/template.py): a replacement that
# joins the survivors' forming round costs them a fork and its script's set-up, well
# under a second, while the hold is all of its wait to be planned (issue 41: a
# replacement training <= 1 s after its predecessor's death). The survivors' own
# round forms in 0.03-0.4 s (4 to 16 workers here); when a worker on the coordinator's
# host says it has (``CoordinatorView.plan_formed``), the hold ends then.
RECOVERY_HOLD_WARM_S = 0.5


@dataclass(frozen=True)
class RendezvousSettings:
    min_np: int
    max_np: int
    settle: float = 0.5  # seconds to wait for more joiners once min_np are present
    timeout: float = 600.0  # seconds to wait below min_np before the job fails
    reset_grace: float = 0.3  # after a reset request, time for the agents' reports to arrive
    # After a round that re-forms a broken ring, time for its survivors to form it before
    # a round that only admits newcomers replaces it (see ``decide``), unless a worker on
    # the coordinator's host reports it formed sooner. Sized to what a newcomer costs
    # the survivors who would wait for it: a cold start imports torch (seconds), a warm
    # one is forked from a template that has (RECOVERY_HOLD_WARM_S).
    recovery_hold: float = 2.0
    # How long the keys of a job whose agents all died stay in etcd (job_lease.py).
    abandoned_after: float = JOB_LEASE_S

    def __post_init__(self) -> None:
        if self.min_np < 1:
            raise ConfigError(f"min_np must be at least 1 (got {self.min_np})")
        if self.max_np < self.min_np:
            raise ConfigError(
                f"max_np ({self.max_np}) must be at least min_np ({self.min_np})"
            )
        if not self.abandoned_after > 0:
            raise ConfigError(f"abandoned_after must be positive (got {self.abandoned_after})")
        for name in ("settle", "timeout", "reset_grace", "recovery_hold"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must not be negative (got {getattr(self, name)})")


@dataclass(frozen=True)
class Member:
    """One host agent, as registered under ``members/<member_id>``."""

    member_id: str
    host: str
    addr: str  # address other hosts reach this host's workers at
    store_port: int  # the agent's TCPStore, used when one of its workers is rank 0
    workers: tuple[str, ...]  # worker ids that want a rank, in local order
    joined: float  # wall-clock registration time, for people reading logs
    revision: int = 0  # etcd create revision of the key: the join order
    draining: bool = False  # leaving gracefully: its withdrawn workers are not "lost"

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "member_id": self.member_id,
                "host": self.host,
                "addr": self.addr,
                "store_port": self.store_port,
                "workers": list(self.workers),
                "joined": self.joined,
                "draining": self.draining,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, data: bytes, revision: int = 0) -> "Member":
        with parsing("member"):
            obj = json.loads(data)
            return cls(
                member_id=text(obj["member_id"], "member_id"),
                host=text(obj["host"], "host"),
                addr=text(obj["addr"], "addr"),
                store_port=_port(obj["store_port"]),
                workers=texts(obj["workers"], "workers"),
                joined=float(obj["joined"]),
                revision=revision,
                draining=bool(obj.get("draining", False)),
            )


def _port(value) -> int:
    port = int(value)
    if not 0 <= port < 65536:
        raise ValueError(f"port {port} out of range")
    return port


@dataclass(frozen=True)
class Slot:
    """A rank of a plan: which worker of which member holds it."""

    member_id: str
    worker_id: str


@dataclass(frozen=True)
class RoundPlan:
    round: int
    slots: tuple[Slot, ...]  # rank order
    hosts: dict  # member_id -> (host, addr), for the members in the plan
    store_addr: str  # "host:port" of the round's rendezvous store (rank 0's agent)
    created: float  # wall-clock time the plan was written
    # Workers of the previous round that died or vanished (not a graceful leave):
    # their ring is broken, so its survivors abort it instead of waiting on it.
    lost: tuple[str, ...] = ()
    reason: str = ""  # why the coordinator formed it, for people and `elastic-run status`
    recovers: bool = False  # formed because the previous ring broke (a loss, a reset request)

    @property
    def world_size(self) -> int:
        return len(self.slots)

    def rank_of(self, worker_id: str) -> Optional[int]:
        for rank, slot in enumerate(self.slots):
            if slot.worker_id == worker_id:
                return rank
        return None

    def worker_ids(self) -> tuple[str, ...]:
        return tuple(slot.worker_id for slot in self.slots)

    def member_order(self) -> list[str]:
        """Members in order of their first rank (torchrun's GROUP_RANK)."""
        seen: dict[str, None] = {}
        for slot in self.slots:
            seen.setdefault(slot.member_id, None)
        return list(seen)

    def local_ranks(self, member_id: str) -> list[str]:
        """Worker ids of one member in local-rank order."""
        return [s.worker_id for s in self.slots if s.member_id == member_id]

    def to_json(self) -> bytes:
        members = self.member_order()
        index = {m: i for i, m in enumerate(members)}
        return json.dumps(
            {
                "round": self.round,
                "created": self.created,
                "store": self.store_addr,
                "members": [[m, *self.hosts[m]] for m in members],
                "ranks": [[index[s.member_id], s.worker_id] for s in self.slots],
                "lost": list(self.lost),
                "reason": self.reason[:200],
                "recovers": self.recovers,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "RoundPlan":
        with parsing("round plan"):
            obj = json.loads(data)
            # [member id, host, addr] per member
            members = [(text(m[0], "member"), text(m[1], "host"), text(m[2], "addr")) for m in obj["members"]]
            slots = []
            for index, worker in obj["ranks"]:
                if not isinstance(index, int) or not 0 <= index < len(members):
                    raise ValueError(f"a rank names member {index!r} of {len(members)}")
                slots.append(Slot(members[index][0], text(worker, "worker")))
            return cls(
                round=int(obj["round"]),
                slots=tuple(slots),
                hosts={m[0]: (m[1], m[2]) for m in members},
                store_addr=text(obj["store"], "store"),
                created=float(obj["created"]),
                lost=texts(obj.get("lost", []), "lost"),
                reason=str(obj.get("reason", "")),
                recovers=bool(obj.get("recovers", False)),
            )


@dataclass(frozen=True)
class ResetRequest:
    """A worker whose collective failed asks for a round after ``round``."""

    worker_id: str
    round: int
    reason: str
    seen_at: float  # coordinator's monotonic time when the request arrived
    lost: tuple[str, ...] = ()  # workers the requester knows to be dead (killed by their agent)

    @classmethod
    def from_json(cls, worker_id: str, data: bytes, seen_at: float) -> "ResetRequest":
        """A request as control.request_reset writes it."""
        with parsing(f"reset request of {worker_id[:80]}"):
            body = json.loads(data)
            return cls(worker_id, int(body["round"]), str(body.get("reason", ""))[:500], seen_at,
                       texts(body.get("lost", []), "lost"))


@dataclass(frozen=True)
class CoordinatorView:
    """What the coordinator knows at one instant (monotonic times)."""

    plan: Optional[RoundPlan]
    members: tuple[Member, ...]
    requests: tuple[ResetRequest, ...] = ()
    last_change: float = 0.0  # when the member set last changed
    below_min_since: Optional[float] = None  # when candidates first fell below min_np
    plan_seen_at: Optional[float] = None  # when the coordinator first saw ``plan``
    # A worker on the coordinator's host reported ``plan``'s ring formed and training:
    # its survivors no longer abandon it for a newer round (the recovery hold ends).
    plan_formed: bool = False
    # Until when members whose lease expired while etcd was away (the coordinator's own
    # refreshes failed until recently) may still renew before they count as lost.
    renew_until: Optional[float] = None
    # Members left out for being cut off from the ring (reachability.py): a loss on them
    # is named as such in the round's reason.
    excluded: frozenset = frozenset()
    # Members whose agents answered a liveness probe since ``plan``'s ring broke, and the
    # member that decides (never probed: it is alive by deciding).
    probed: frozenset = frozenset()
    leader: str = ""


@dataclass(frozen=True)
class Wait:
    until: Optional[float] = None  # re-decide at this time even without news
    reason: str = ""


@dataclass(frozen=True)
class FormRound:
    slots: tuple[Slot, ...]
    reason: str
    lost: tuple[str, ...] = ()
    recovers: bool = False  # the previous ring broke: see RoundPlan.recovers


@dataclass(frozen=True)
class ProbeLiveness:
    """A ring broke and no agent has explained it yet: before a round is formed, probe
    these members' agents (liveness.py) and drop the dead ones, so the round never names
    a dead agent's store or waits on its workers. The answers come back as
    ``CoordinatorView.probed``."""

    members: tuple[str, ...]


@dataclass(frozen=True)
class StopJob:
    """Graceful leaves would take the job below min_np: stop it at a commit instead."""

    reason: str


@dataclass(frozen=True)
class Fail:
    reason: str


Decision = Union[Wait, FormRound, ProbeLiveness, Fail, StopJob]


def _may_still_renew(plan: RoundPlan, view: CoordinatorView, lost: tuple[str, ...], now: float) -> bool:
    """Are all ``lost`` workers on members whose key vanished (an expired lease, not a
    worker withdrawn by its agent), within the renewal window after an etcd outage, with
    the ring unbroken?"""
    if view.renew_until is None or now >= view.renew_until:
        return False
    if any(r.round >= plan.round for r in view.requests):
        return False  # the ring broke: a real loss, and the survivors are waiting
    present = {m.member_id for m in view.members}
    owners = {s.worker_id: s.member_id for s in plan.slots}
    return all(owners[w] not in present for w in lost)


def _with_cut(reason: str, view: CoordinatorView, lost: tuple[str, ...]) -> str:
    """A loss's reason, naming the members that hold ranks and were left out for being
    cut off from the ring (their workers may live on: the log must not say "died")."""
    cut = sorted(m for m in view.excluded if lost and view.plan is not None and view.plan.local_ranks(m))
    return f"{reason}: {', '.join(cut)} unreachable from the ring" if cut else reason


def candidates(plan: Optional[RoundPlan], members: tuple[Member, ...]) -> list[Slot]:
    """All workers that want a rank, in stable rank order (no max_np cut yet)."""
    offered = {
        w: m.member_id for m in members for w in m.workers
    }
    ordered: list[Slot] = []
    if plan is not None:
        # Survivors first, in their previous order: rank 0 stays the oldest.
        ordered = [s for s in plan.slots if offered.get(s.worker_id) == s.member_id]
    taken = {s.worker_id for s in ordered}
    for member in sorted(members, key=lambda m: (m.revision, m.member_id)):
        for worker in member.workers:
            if worker not in taken:
                ordered.append(Slot(member.member_id, worker))
                taken.add(worker)
    return ordered


def candidate_count(members: tuple[Member, ...]) -> int:
    """``len(candidates(plan, members))`` without ordering them: every offered worker is
    a candidate exactly once (cheap enough for the coordinator's every step)."""
    return len({w for m in members for w in m.workers})


def decide(view: CoordinatorView, settings: RendezvousSettings, now: float) -> Decision:
    plan = view.plan
    wanted = candidates(plan, view.members)
    admitted = tuple(wanted[: settings.max_np])
    count = len(admitted)

    if count < settings.min_np and plan is not None and not view.requests:
        # Decided here, in one place, for the whole job: several hosts told to leave at
        # once (each seeing enough workers without itself) must not drain it empty.
        draining = {m.member_id for m in view.members if m.draining}
        offered = {w for m in view.members for w in m.workers}
        leaving = [s for s in plan.slots if s.member_id in draining]
        crashed = [s for s in plan.slots if s.worker_id not in offered and s.member_id not in draining]
        if leaving and not crashed:
            return StopJob(
                f"{len(leaving)} worker(s) leaving would leave {count}, below min_np={settings.min_np}"
            )

    if count < settings.min_np:
        since = view.below_min_since if view.below_min_since is not None else now
        if now - since >= settings.timeout:
            return Fail(
                f"only {count} of min_np={settings.min_np} workers present after "
                f"waiting {settings.timeout:g}s"
            )
        return Wait(since + settings.timeout, f"{count} of min_np={settings.min_np} present")

    if plan is None:
        if count == settings.max_np:
            return FormRound(admitted, f"max_np={settings.max_np} workers present")
        settle_at = view.last_change + settings.settle
        if now >= settle_at:
            return FormRound(admitted, f"{count} workers present, settle window over")
        return Wait(settle_at, "settling")

    previous = set(plan.worker_ids())
    gone = previous - {s.worker_id for s in admitted}
    # A round after a loss or a broken ring is formed by the survivors alone when they
    # are enough: a newcomer (a replacement, a spare) is a process that has yet to
    # start and import torch, seconds the survivors would wait in the round's set-up.
    # It joins at a later commit like any joiner, without stalling anyone.
    survivors = tuple(s for s in admitted if s.worker_id in previous)
    recovering = survivors if len(survivors) >= settings.min_np else admitted
    if gone:
        draining = {m.member_id for m in view.members if m.draining}
        lost = tuple(s.worker_id for s in plan.slots if s.worker_id in gone and s.member_id not in draining)
        left = len(gone) - len(lost)
        settle_at = view.last_change + settings.settle
        if not lost and now < settle_at:
            # Only graceful leaves: the ring keeps training meanwhile, so settle to batch
            # hosts told to leave together (a scale-down signals several pods at once)
            # into one round, and one min_np decision above, instead of one per host.
            return Wait(settle_at, "settling leaves")
        if lost and _may_still_renew(plan, view, lost, now):
            # etcd was away (frozen, restarted, cut off from us): it may have expired a
            # lease whose keep-alive had no chance to get through, of a host whose workers
            # still train. Their ring is intact (nobody asked for a reset): give the member
            # one TTL to renew and re-register rather than drop a healthy host.
            return Wait(view.renew_until, "etcd was away: members whose lease expired may still renew")
        # A loss is never worth waiting for: the survivors are stalled until the next round.
        reason = ", ".join(
            part for part in (f"{len(lost)} worker(s) lost" if lost else "", f"{left} left" if left else "") if part
        )
        return FormRound(recovering, _with_cut(reason, view, lost), lost, recovers=bool(lost))

    requests = [r for r in view.requests if r.round >= plan.round]
    if requests:
        known_lost = tuple(dict.fromkeys(w for r in requests for w in r.lost))
        if known_lost:
            # An agent killed these itself: nothing more to wait for.
            return FormRound(recovering, _with_cut(f"reset requested: {requests[0].reason}", view, known_lost),
                             known_lost, recovers=True)
        # Give the agents a moment to report the crash behind the broken ring, so the
        # new round does not include a dead worker; then re-form with whoever is there.
        first = min(r.seen_at for r in requests)
        if now >= first + settings.reset_grace:
            unprobed = tuple(sorted({s.member_id for s in recovering} - view.probed - {view.leader}))
            if unprobed:
                return ProbeLiveness(unprobed)
            return FormRound(recovering, f"reset requested: {requests[0].reason}", recovers=True)
        return Wait(first + settings.reset_grace, "reset requested, waiting for reports")

    if admitted == plan.slots:
        return Wait(None, "membership unchanged")

    # Only additions: the running ring keeps going, so settle to batch joiners.
    if plan.recovers and not view.plan_formed and view.plan_seen_at is not None \
            and now < view.plan_seen_at + settings.recovery_hold:
        # The survivors of a broken ring may still be forming this plan's round. A newer
        # plan now would make them abandon it for one that waits on the newcomers (a
        # replacement offered with the crash report is still starting: a stall for all).
        # Once their round runs, newcomers join at a commit without a stall: a worker
        # of ours that says so ends the hold; the hold is for a ring without one.
        return Wait(view.plan_seen_at + settings.recovery_hold, "letting the survivors form their round first")
    if count == settings.max_np:
        return FormRound(admitted, f"{count - len(previous)} worker(s) joined, max_np reached")
    settle_at = view.last_change + settings.settle
    if now >= settle_at:
        return FormRound(admitted, f"{count - len(previous)} worker(s) joined")
    return Wait(settle_at, "settling joiners")
