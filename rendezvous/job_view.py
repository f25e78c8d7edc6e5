"""What a job is doing, as read from etcd alone (``elastic-run status``).

``read_job`` takes one consistent read of the job's keys (one range request at
one revision, plus the TTL of the lease that keeps an ended job's history);
``job_view`` is a pure function from that snapshot to a ``JobView``, tested
without etcd. Rendering is the caller's (``elastic/cli/status.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from .control import RUNNING, STOPPING, JobStatus
from .etcd import Etcd
from .keys import JobKeys
from .errors import MalformedValueError
from .rounds import Member, ResetRequest, RoundPlan
from .waiting import WaitingNotice

# Rounds listed by default (etcd keeps KEEP_ROUNDS of them).
RECENT_ROUNDS = 10


@dataclass(frozen=True)
class JobSnapshot:
    """The raw keys of one job at one etcd revision: key (below the job's prefix) -> value."""

    job_id: str
    values: dict  # relative key -> bytes
    read_at: float  # wall-clock time of the read
    history_ttl: Optional[float] = None  # seconds left on the lease keeping an ended job's keys


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    rank: Optional[int]  # None: not in the current round (a spare, or not started yet)


@dataclass(frozen=True)
class MemberView:
    member_id: str
    host: str
    addr: str
    workers: tuple[WorkerView, ...]
    joined: float
    draining: bool
    coordinator: bool


@dataclass(frozen=True)
class RoundView:
    round: int
    time: float
    world_size: int
    reason: str
    lost: int


@dataclass(frozen=True)
class RequestView:
    worker_id: str
    round: int
    reason: str


@dataclass(frozen=True)
class JobView:
    job_id: str
    state: str  # running, stopping, succeeded, failed
    reason: str
    since: Optional[float]  # when the state was written (None: not recorded)
    round: Optional[int]
    world_size: int
    coordinator: Optional[str]  # member id
    members: tuple[MemberView, ...]
    rounds: tuple[RoundView, ...]  # newest first
    requests: tuple[RequestView, ...]
    note: str  # one sentence on anything odd (every agent gone, waiting for workers)
    history_expires_in: Optional[float]  # an ended job: seconds until its keys vanish

    def to_dict(self) -> dict:
        return asdict(self)


def read_job(etcd: Etcd, keys: JobKeys, *, now: float, deadline: Optional[float] = None) -> Optional[JobSnapshot]:
    """The job's keys, or None when etcd holds nothing of it (unknown, or long ended)."""
    kvs, _ = etcd.get_prefix(keys.prefix, retry_deadline=deadline)
    if not kvs:
        return None
    values = {kv.key[len(keys.prefix):]: kv.value for kv in kvs}
    status = next((kv for kv in kvs if kv.key == keys.status), None)
    job_lease = next((kv.lease for kv in kvs if kv.key == keys.job_lease), 0)
    # A status on a lease of its own is an ended job's history (history.py); on the job
    # lease it is a running job's.
    kept = status is not None and status.lease and status.lease != job_lease
    ttl = etcd.lease_time_to_live(status.lease) if kept else None
    return JobSnapshot(keys.job_id, values, now, ttl if ttl is None or ttl >= 0 else None)


def job_view(snapshot: JobSnapshot, *, recent: int = RECENT_ROUNDS) -> JobView:
    values = snapshot.values
    unreadable: list[str] = []  # keys whose values do not parse: left out, named in the note

    def parsed(key: str, parse):
        if not values.get(key):
            return None
        try:
            return parse(values[key])
        except MalformedValueError:
            unreadable.append(key)
            return None

    def each(prefix: str, parse) -> list:
        found = (parsed(k, lambda v, k=k: parse(k[len(prefix):], v)) for k in sorted(values) if k.startswith(prefix))
        return [item for item in found if item is not None]

    status = parsed("control/status", JobStatus.from_json) or JobStatus()
    plan = parsed("control/plan", RoundPlan.from_json)
    coordinator = values["coordinator"].decode(errors="replace") if values.get("coordinator") else None
    waiting = parsed("control/waiting", WaitingNotice.from_json)
    members = sorted(each("members/", lambda _k, v: Member.from_json(v)), key=lambda m: (m.joined, m.member_id))
    rounds = sorted(each("rounds/", lambda _k, v: RoundPlan.from_json(v)), key=lambda p: -p.round)
    requests = tuple(each("requests/", _request))
    member_views = tuple(
        MemberView(
            m.member_id, m.host, m.addr,
            tuple(WorkerView(w, plan.rank_of(w) if plan is not None else None) for w in m.workers),
            m.joined, m.draining, m.member_id == coordinator,
        )
        for m in members
    )
    return JobView(
        job_id=snapshot.job_id,
        state=status.state,
        reason=status.reason,
        since=status.since or None,
        round=plan.round if plan is not None else None,
        world_size=plan.world_size if plan is not None else 0,
        coordinator=coordinator,
        members=member_views,
        rounds=tuple(RoundView(p.round, p.created, p.world_size, p.reason, len(p.lost)) for p in rounds[:recent]),
        requests=requests,
        note=_with_unreadable(_note(status, plan, member_views, waiting), unreadable),
        history_expires_in=snapshot.history_ttl,
    )


def _request(worker_id: str, value: bytes) -> RequestView:
    request = ResetRequest.from_json(worker_id, value, 0.0)
    return RequestView(worker_id, request.round, request.reason)


def _with_unreadable(note: str, unreadable: list) -> str:
    if not unreadable:
        return note
    said = f"unreadable keys left out: {', '.join(unreadable[:5])}" + (" ..." if len(unreadable) > 5 else "")
    return f"{note}; {said}" if note else said


def _note(status: JobStatus, plan: Optional[RoundPlan], members: tuple[MemberView, ...],
          waiting: Optional[WaitingNotice]) -> str:
    offered = sum(len(m.workers) for m in members)
    if status.state in (RUNNING, STOPPING) and not members:
        # Members live on their agents' leases: none left means no agent is alive.
        return "no agent is registered: every agent has left or died" + (
            " (the job stopped at a commit)" if status.state == STOPPING else "")
    if status.state == RUNNING and waiting is not None:
        return (f"waiting for workers: {waiting.present} of {waiting.min_np} present "
                f"(the job fails if --rdzv-timeout runs out first)")
    if status.state == RUNNING and plan is None:
        return f"waiting for the first round: {offered} worker(s) offered"
    if status.state == RUNNING and plan is not None:
        in_plan = sum(1 for m in members for w in m.workers if w.rank is not None)
        if in_plan < plan.world_size:
            return f"{plan.world_size - in_plan} worker(s) of round {plan.round} gone: a new round is coming"
    return ""

