"""What happened in a job, read from its events: a pure model, no I/O, no drawing.

``build(events)`` turns the events of every host (agents and workers, any order)
into a ``Timeline``: the world size over time, one lane per worker with its spans
of steps (``steps`` events, see ``elastic/worker/step_log.py``), the failures, joins and
leaves, and each re-formation of the ring with its phases.

Times are wall-clock seconds since the first event. Events of several hosts are
merged on their own clocks: skew between hosts shifts their marks by as much.

A re-formation is one round entered through the recovery path: the workers' own
``reform_done`` events of that round, each with the durations of its phases. Its
band starts at the failure that caused it (the victim's exit, when the agent saw
one) or else at the first worker's detection, and ends when the last worker has
synced. Phases, drawn in this order:

    detect      the failure until the first survivor noticed it
    abort       leaving the old ring and rolling back (drop_s and the rest)
    rendezvous  waiting for the next round's plan
    pg init     every worker arriving at the round's store, the process group
    sync        rank 0's committed state to everyone
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from typing import Iterable, Optional

PHASES = ("detect", "abort", "rendezvous", "pg init", "sync")

# The agent's failure_detected reasons (elastic/agent/agent.py) name the worker.
_WORKER_IN_REASON = re.compile(r"worker (\S+) (died|failed)")
_SIGNAL_IN_REASON = re.compile(r"signal (\d+)")


@dataclass(frozen=True)
class Span:
    start: float
    end: float
    first: int  # commit numbers, inclusive
    last: int
    round: Optional[int]
    world_size: int = 0


@dataclass
class Lane:
    """One worker process (a replacement worker is a lane of its own)."""

    worker: str
    host: str
    started: Optional[float] = None
    exited: Optional[float] = None
    exit_code: Optional[int] = None
    signal: Optional[int] = None
    ranks: list[int] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return sum(s.last - s.first + 1 for s in self.spans)

    @property
    def member(self) -> str:
        return self.worker.rsplit(".", 1)[0]

    def label(self, owner: str) -> str:
        local = self.worker.rsplit(".", 1)[-1]
        ranks = "/".join(str(r) for r in dict.fromkeys(self.ranks))
        return f"{owner} {local}" + (f" (rank {ranks})" if ranks else "")


@dataclass(frozen=True)
class Failure:
    time: float
    worker: Optional[str]
    host: str
    reason: str
    kind: str  # "killed" (a signal), "died" (an exit code), "hung", "error" (user code), "network"


@dataclass(frozen=True)
class MemberChange:
    time: float
    host: str
    member: Optional[str]
    kind: str  # "joined", "left", "leaving"


@dataclass(frozen=True)
class WorkerReform:
    """One worker's ``reform_done``: when it noticed, and its phases in seconds."""

    worker: str
    rank: Optional[int]
    detected: float  # when this worker noticed (done - total)
    done: float
    abort: float
    rendezvous: float
    pg_init: float
    sync: float
    commit: Optional[int]  # the commit the new ring resumed from


@dataclass
class Reformation:
    round: int
    failed: bool  # True: the ring broke and rolled back; False: a switch at a commit (a join, a leave)
    world_size: int  # of the new ring
    workers: list[WorkerReform]
    cause: Optional[Failure] = None

    @property
    def start(self) -> float:
        first = min(w.detected for w in self.workers)
        return min(first, self.cause.time) if self.cause is not None else first

    @property
    def end(self) -> float:
        return max(w.done for w in self.workers)

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def resumed_commit(self) -> Optional[int]:
        commits = [w.commit for w in self.workers if w.commit is not None]
        return max(commits) if commits else None

    def phases(self) -> list[tuple[str, float, float]]:
        """(phase, start, end) of the band: detection, then the last worker's phases
        (the ring trains again only once that worker has synced)."""
        last = max(self.workers, key=lambda w: w.done)
        first_noticed = min(w.detected for w in self.workers)
        out = []
        if self.start < first_noticed:
            out.append(("detect", self.start, first_noticed))
        t = max(last.detected, first_noticed)
        # Stack backwards from its end so the phases end exactly at the band's end.
        tail = [("sync", last.sync), ("pg init", last.pg_init), ("rendezvous", last.rendezvous)]
        end = last.done
        stacked = []
        for name, seconds in tail:
            stacked.append((name, max(t, end - seconds), end))
            end = max(t, end - seconds)
        out.append(("abort", t, end))
        out.extend(reversed(stacked))
        return [p for p in out if p[2] > p[1]]


@dataclass
class Timeline:
    t0: float  # wall time of the first event; every time below is relative to it
    end: float
    lanes: list[Lane]
    world: list[tuple[float, int]]  # (time, world size of the ring training from then on)
    reformations: list[Reformation]
    failures: list[Failure]
    changes: list[MemberChange]
    outcome: Optional[str] = None  # job_finished status
    outcome_reason: Optional[str] = None

    def lane_labels(self) -> list[str]:
        """"host w0 (rank 2)"; the member id instead of the host when a host runs several agents."""
        members_of: dict[str, set] = {}
        for lane in self.lanes:
            members_of.setdefault(lane.host, set()).add(lane.member)
        return [lane.label(f"{lane.host}#{lane.member.rsplit('-', 1)[-1]}" if len(members_of[lane.host]) > 1
                           else lane.host) for lane in self.lanes]

    @property
    def initial_world(self) -> int:
        return self.world[0][1] if self.world else len(self.lanes)

    def recovery_of(self, failure: Failure) -> Optional[Reformation]:
        return next((r for r in self.reformations if r.cause is failure), None)

    def steps_before(self, time: float) -> Optional[int]:
        """The highest commit any worker reached before ``time`` (from its step spans)."""
        reached = [s.last for lane in self.lanes for s in lane.spans if s.end <= time]
        return max(reached) if reached else None

    def headline(self) -> str:
        """One line saying what happened, for the picture's title."""
        parts = [f"{self.initial_world} worker{'s' * (self.initial_world != 1)}"]
        kills = [f for f in self.failures if f.kind in ("killed", "died", "hung")]
        if kills:
            verb = {"killed": "killed", "died": "died", "hung": "hung"}
            kinds = sorted({verb[f.kind] for f in kills})
            what = "/".join(kinds)
            times = ", ".join(f"{f.time:.1f}" for f in kills[:4]) + (", ..." if len(kills) > 4 else "")
            recovered = [r.end - f.time for f in kills for r in [self.recovery_of(f)] if r is not None]
            text = f"{len(kills)} {what} at {times} s"
            if len(recovered) == 1:
                text += f" (recovered in {recovered[0]:.2f} s)"
            elif recovered:
                text += f" (recovered in {statistics.median(recovered):.2f} s median, {max(recovered):.2f} s max)"
            parts.append(text)
        other = [f for f in self.failures if f.kind not in ("killed", "died", "hung")]
        if other:
            parts.append(f"{len(other)} other failure{'s' * (len(other) > 1)}")
        for kind in ("joined", "left"):
            hosts = [c for c in self.changes if c.kind == kind]
            if hosts:
                times = ", ".join(f"{c.time:.1f}" for c in hosts[:4])
                parts.append(f"{len(hosts)} host{'s' * (len(hosts) > 1)} {kind} at {times} s")
        if self.outcome:
            parts.append(f"{self.outcome} at {self.end:.1f} s")
        return ", ".join(parts)


def build(events: Iterable[dict]) -> Timeline:
    """The timeline of ``events`` (dicts as in events.jsonl). Raises ValueError if empty."""
    events = sorted((e for e in events if isinstance(e.get("time"), (int, float)) and e.get("event")),
                    key=lambda e: e["time"])
    if not events:
        raise ValueError("no events")
    t0 = events[0]["time"]
    rel = lambda t: t - t0  # noqa: E731
    lanes: dict[tuple[str, Optional[int]], Lane] = {}  # (worker id, pid) -> lane
    by_worker: dict[str, Lane] = {}  # the newest lane of each worker id
    failures: list[Failure] = []
    changes: list[MemberChange] = []
    reforms: dict[int, Reformation] = {}
    formed: list[tuple[float, int]] = []  # round_formed (coordinator's plans)
    first_started: Optional[float] = None
    outcome = outcome_reason = None
    end = 0.0

    def lane_of(worker: str, host: str) -> Lane:
        if worker not in by_worker:
            by_worker[worker] = lanes[(worker, None)] = Lane(worker, host)
        return by_worker[worker]

    for e in events:
        kind, t, host = e["event"], rel(e["time"]), str(e.get("host") or "?")
        end = max(end, t)
        worker = e.get("worker")
        if kind == "worker_started" and worker:
            lane = Lane(worker, host, started=t)
            lanes[(worker, e.get("pid"))] = by_worker[worker] = lane
            if e.get("rank") is not None:
                lane.ranks.append(e["rank"])
            first_started = t if first_started is None else first_started
        elif kind == "worker_exited" and worker:
            lane = lane_of(worker, host)
            lane.exited, lane.exit_code, lane.signal = t, e.get("exit_code"), e.get("signal")
        elif kind == "steps" and worker:
            lane = lane_of(worker, host)
            span = Span(rel(e.get("start", e["time"])), rel(e.get("end", e["time"])),
                        int(e.get("first", 0)), int(e.get("last", 0)), e.get("round"), int(e.get("world_size") or 0))
            lane.spans.append(span)
            if e.get("rank") is not None and (not lane.ranks or lane.ranks[-1] != e["rank"]):
                lane.ranks.append(e["rank"])
        elif kind == "failure_detected" and e.get("rank") is None:
            # The agent's verdict (the workers' own are in reform_done), dated by the exit it saw.
            failure = _failure(t, host, e)
            victim = by_worker.get(failure.worker or "")
            if victim is not None and victim.exited is not None and victim.exited <= t:
                failure = Failure(victim.exited, failure.worker, host, failure.reason, failure.kind)
            failures.append(failure)
        elif kind == "reform_done" and e.get("round") is not None:
            times = WorkerReform(
                worker=str(worker or f"{host} rank {e.get('rank')}"), rank=e.get("rank"),
                detected=t - float(e.get("total_s") or 0), done=t,
                abort=float(e.get("detect_s") or 0), rendezvous=float(e.get("rendezvous_s") or 0),
                pg_init=float(e.get("pg_init_s") or 0), sync=float(e.get("sync_s") or 0), commit=e.get("commit"),
            )
            reform = reforms.setdefault(e["round"], Reformation(e["round"], bool(e.get("failed")),
                                                                 int(e.get("world_size") or 0), []))
            reform.workers.append(times)
            reform.failed = reform.failed or bool(e.get("failed"))
        elif kind == "round_formed":
            formed.append((t, int(e.get("world_size") or 0)))
        elif kind == "member_joined" and (first_started is not None or e.get("rejoined")):
            changes.append(MemberChange(t, host, e.get("member"), "joined"))  # not the job's first hosts
        elif kind == "graceful_leave":
            changes.append(MemberChange(t, host, e.get("member"), "leaving"))
        elif kind == "member_left":
            changes.append(MemberChange(t, host, e.get("member"), "left"))
        elif kind == "job_finished" and outcome is None:
            outcome, outcome_reason = str(e.get("status")), e.get("reason")

    reformations = sorted(reforms.values(), key=lambda r: r.end)
    _attach_causes(reformations, failures)
    ordered = sorted(lanes.values(), key=lambda l: (l.started if l.started is not None else
                                                   (l.spans[0].start if l.spans else end), l.worker))
    return Timeline(t0, end, ordered, _world(formed, reformations, ordered), reformations,
                    failures, changes, outcome, outcome_reason)


def _failure(t: float, host: str, e: dict) -> Failure:
    reason = str(e.get("reason") or "")
    match = _WORKER_IN_REASON.search(reason)
    worker = e.get("worker") or (match.group(1) if match else None)
    if e.get("user_error"):
        kind = "error"
    elif e.get("network"):
        kind = "network"
    elif "declared hung" in reason:  # the watchdog's kill (its hang_detected event comes first)
        kind = "hung"
    elif _SIGNAL_IN_REASON.search(reason):
        kind = "killed"
    else:
        kind = "died"
    return Failure(t, worker, host, reason, kind)


def _attach_causes(reformations: list[Reformation], failures: list[Failure]) -> None:
    """Each failure caused the first failed re-formation that ends after it (and
    started, i.e. was noticed, no earlier than a second before it)."""
    taken: set[int] = set()
    for failure in failures:
        for reform in reformations:
            if not reform.failed or id(reform) in taken or reform.cause is not None:
                continue
            noticed = min(w.detected for w in reform.workers)
            if reform.end > failure.time and noticed >= failure.time - 1.0:
                reform.cause = failure
                taken.add(id(reform))
                break


def _world(formed, reformations: list[Reformation], lanes: list[Lane]) -> list[tuple[float, int]]:
    """The size of the ring that trains, over time: the first round's, then each
    re-formation's from its end. Without worker records, the coordinator's plans."""
    first = None
    spans = sorted((s for lane in lanes for s in lane.spans if s.world_size), key=lambda s: s.start)
    if spans:
        first = (spans[0].start, spans[0].world_size)
    elif formed:
        first = formed[0]
    if first is None:
        return list(formed)
    world = [first] + [(r.end, r.world_size) for r in reformations if r.end >= first[0]]
    return world
