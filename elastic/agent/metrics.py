"""Prometheus metrics of one agent, served at ``GET /metrics`` on its ``--health-port``.

Everything here is fed from what the agent already sees; nothing per step goes to
etcd and nothing is read from the training loop:

* events (``observe``): the agent's own and its workers' lines of ``events.jsonl``,
  handed over one by one by ``Agent._observe``;
* progress boards (``observe_marks``): the shared-memory marks the hang watchdog
  reads on each turn of the agent's loop (``progress.py``); a commit counts itself
  there and adds its interval to a total, so commits and step time cost the worker
  no event and no system call.

A "step" is what the runtime can see of one: the interval between two commits of
a round (a script that commits every step gets its step time). The interval that
ends at a round's first commit is left out: it holds the re-formation.

Every value is this host's view: a counter of re-formations counts the rounds this
agent followed, the recovery histogram the re-formations its workers went through
(one observation per round, the first of its workers to report). Use ``max`` over
hosts, not ``sum``, for the job's figures.

The registry is the agent's own (not prometheus_client's global one), so tests and
embedded agents in one process never share series.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Mapping, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..contract.progress import Marks

__all__ = ["AgentMetrics", "CONTENT_TYPE_LATEST", "REFORMATION_KINDS", "round_change"]

# Why a round replaced the one before, as the agent sees it (round_change):
REFORMATION_KINDS = ("failure", "leave", "join", "reset")
RECOVERY_PHASES = ("detect", "rendezvous", "pg_init", "sync", "total")
# reform_done's field of each phase
_PHASE_FIELDS = {"detect": "detect_s", "rendezvous": "rendezvous_s", "pg_init": "pg_init_s",
                 "sync": "sync_s", "total": "total_s"}
# Recovery takes from tens of milliseconds (a planned switch) to minutes (a dead
# coordinator's lease running out, a joiner importing torch).
_RECOVERY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, float("inf"))


def round_change(previous, plan) -> dict[str, Any]:
    """The fields of the agent's ``round_started`` event: ``plan`` replaces ``previous``
    (both ``RoundPlan``; ``previous`` None for the first round this agent follows).

    kind: "start" (the job's first round), "failure" (workers were lost), "leave"
    (workers left gracefully), "join" (workers joined, or this host joined a running
    job), "reset" (the same workers: a ring reset after a failure nobody was lost in).
    """
    now = set(plan.worker_ids())
    before = set(previous.worker_ids()) if previous is not None else set()
    lost = set(plan.lost) & before if previous is not None else set()
    joined, left = now - before, before - now - lost
    if previous is None:
        kind = "start" if plan.round == 1 else "join"
    elif lost:
        kind = "failure"
    elif left:
        kind = "leave"
    elif joined:
        kind = "join"
    else:
        kind = "reset"
    return {"round": plan.round, "world_size": plan.world_size, "kind": kind,
            "lost": len(lost), "joined": len(joined) if previous is not None else 0, "left": len(left)}


class AgentMetrics:
    """The metrics of one agent, in a registry of its own.

    ``host``: the agent's host id; events of other hosts (agents sharing a log
    directory) are ignored. ``member``: the agent's member id; another agent's worker
    starts (two agents of one host id in one log directory) are not our restarts.
    Thread-safe: the agent feeds it, the HTTP server reads.
    """

    def __init__(self, host: Optional[str] = None, member: Optional[str] = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.host = host
        self.member = member
        self._clock = clock
        self._lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.world_size = Gauge("elastic_world_size", "Workers in the job's current round", registry=r)
        self.round = Gauge("elastic_round", "Number of the current round (re-formation)", registry=r)
        self.reformations = Counter(
            "elastic_reformations", "Rounds that replaced a running one, by why (failure, leave, join, reset)",
            ["kind"], registry=r)
        self.worker_restarts = Counter(
            "elastic_worker_restarts", "Workers this agent started again after one died", registry=r)
        self.recovery = Histogram(
            "elastic_recovery_seconds",
            "Duration of a re-formation by phase (detect, rendezvous, pg_init, sync, total); "
            "kind: failure (rolled back) or planned (switch at a commit)",
            ["phase", "kind"], buckets=_RECOVERY_BUCKETS, registry=r)
        self.commits = Counter("elastic_commits", "Commits of the ring, as seen by this host's workers", registry=r)
        self.step_seconds = Gauge(
            "elastic_step_seconds", "Mean time between two commits of a round, over the last few commits",
            ["worker", "rank"], registry=r)
        self.checkpoint_time = Gauge(
            "elastic_checkpoint_last_timestamp_seconds", "Wall time the last durable checkpoint was published",
            registry=r)
        self.checkpoint_step = Gauge("elastic_checkpoint_last_step", "Commit number of the last durable checkpoint",
                                     registry=r)
        self.checkpoint_bytes = Gauge("elastic_checkpoint_last_bytes", "Size of the last durable checkpoint",
                                      registry=r)
        self.checkpoint_write_seconds = Gauge(
            "elastic_checkpoint_last_write_seconds", "Background write time of the last durable checkpoint",
            registry=r)
        self.checkpoint_failures = Counter(
            "elastic_checkpoint_failures", "Durable checkpoint writes that failed or were refused", registry=r)
        self.straggler_score = Gauge(
            "elastic_straggler_score", "A worker's compute time per step over the median of all ranks (1: typical)",
            ["worker", "rank"], registry=r)
        self.straggler_reports = Counter(
            "elastic_straggler_reports",
            "Times a worker was reported as a straggler (its score over --straggler-ratio for a run of windows)",
            ["worker"], registry=r)
        self.straggler_evictions = Counter(
            "elastic_straggler_evictions", "Times this agent left the job because its worker was a straggler "
            "(--evict-stragglers)", registry=r)
        # Sharded state (elastic.ShardedState): the copies each commit keeps on peers, and re-shards.
        self.replica_lag = Gauge(
            "elastic_shard_replica_lag_seconds", "Seconds the newest commit's shard copies took to reach their "
            "replica holders, or have been travelling so far (sharded state)", ["worker", "rank"], registry=r)
        self.replica_bytes = Gauge(
            "elastic_shard_replica_bytes_per_commit", "Bytes this host's workers send to replica holders per commit "
            "in the current ring (sharded state)", registry=r)
        self.replicas_held = Gauge(
            "elastic_shard_replicas_held_bytes", "Bytes of other workers' committed shards this host's workers keep "
            "(sharded state)", registry=r)
        self.reshards = Counter(
            "elastic_reshards", "Re-shards of the sharded state this host's workers made, by where the commit came "
            "from (memory: own copies and replicas; disk: a durable checkpoint; start)", ["source"], registry=r)
        self.reshard_bytes = Counter(
            "elastic_reshard_received_bytes", "Bytes this host's workers received from peers in re-shards", registry=r)
        self.reshard_seconds = Gauge(
            "elastic_reshard_last_seconds", "Duration of the last re-shard (the slowest of this host's workers)",
            registry=r)
        for kind in REFORMATION_KINDS:
            self.reformations.labels(kind)  # every kind shows, at 0, before it first happens
        for source in ("memory", "disk"):
            self.reshards.labels(source)
        self._reshard: dict[str, tuple[int, dict]] = {}  # per worker: (round, its last resharded event)
        self._round = 0
        self._counted_round = 0
        self._initial_workers: Optional[int] = None
        self._started = 0
        self._recovered_rounds: set[Any] = set()
        self._seen: dict[str, Marks] = {}  # per worker: the marks of the previous turn
        self._ranks: dict[str, str] = {}  # per worker: the rank label its series carry
        self._last: dict[tuple[Gauge, str], float] = {}  # (gauge, worker): its value, to move it to a new rank

    # -- feeding ----------------------------------------------------------------------
    def observe(self, event: Mapping[str, Any]) -> None:
        """One event of this host (in file order)."""
        if self.host is not None and event.get("host") not in (None, self.host):
            return
        handler = self._HANDLERS.get(event.get("event"))
        if handler is not None:
            with self._lock:
                handler(self, event)

    def observe_marks(self, marks: Mapping[str, Marks], plan=None) -> None:
        """The progress marks of the live workers, read on one turn of the agent's loop."""
        with self._lock:
            ring_commits = 0
            for worker, now in marks.items():
                before = self._seen.get(worker)
                if before is None or now.commits < before.commits:
                    before = Marks()  # a new worker (or a new board): counts from zero
                self._seen[worker] = now
                ring_commits = max(ring_commits, now.commits - before.commits)
                steps = now.steps - before.steps
                if steps > 0:
                    rank = plan.rank_of(worker) if plan is not None else None
                    self._set(self.step_seconds, worker, rank, (now.step_total - before.step_total) / steps)
                lag = now.replica_lag(time.monotonic())  # the board's times are the host's monotonic clock
                if lag is not None:
                    rank = plan.rank_of(worker) if plan is not None else None
                    self._set(self.replica_lag, worker, rank, lag)
            # Every worker of the ring makes the same commits: count them once.
            if ring_commits:
                self.commits.inc(ring_commits)

    def exposition(self) -> bytes:
        """The text format for ``GET /metrics``."""
        return generate_latest(self.registry)

    # -- events ------------------------------------------------------------------------
    def _on_agent_started(self, event: Mapping[str, Any]) -> None:
        if self._ours(event.get("member")):
            self._initial_workers = int(event.get("workers") or 0)

    def _on_worker_started(self, event: Mapping[str, Any]) -> None:
        if not self._ours(str(event.get("worker")).rsplit(".", 1)[0]):
            return
        self._started += 1
        if self._initial_workers is not None and self._started > self._initial_workers:
            self.worker_restarts.inc()

    def _on_worker_exited(self, event: Mapping[str, Any]) -> None:
        worker = event.get("worker")
        self._seen.pop(worker, None)
        rank = self._ranks.pop(worker, None)
        self._reshard.pop(worker, None)
        for gauge in self._per_worker_gauges():
            self._last.pop((gauge, worker), None)
        if rank is not None:
            for gauge in self._per_worker_gauges():
                try:
                    gauge.remove(worker, rank)
                except KeyError:
                    pass

    def _on_round_started(self, event: Mapping[str, Any]) -> None:
        self._set_round(event)
        round_number, kind = event.get("round"), event.get("kind")
        # The agent tells a round again when it could not act on it at once (etcd away).
        if not isinstance(round_number, int) or round_number <= self._counted_round:
            return
        self._counted_round = round_number
        if kind in REFORMATION_KINDS:
            self.reformations.labels(kind).inc()

    def _on_round_formed(self, event: Mapping[str, Any]) -> None:
        self._set_round(event)  # the coordinator's line: usually before round_started

    def _on_reform_done(self, event: Mapping[str, Any]) -> None:
        self._set_round(event)
        round_number = event.get("round")
        if round_number in self._recovered_rounds:
            return  # another local worker of the same re-formation
        self._recovered_rounds.add(round_number)
        kind = "failure" if event.get("failed") else "planned"
        for phase, name in _PHASE_FIELDS.items():
            value = event.get(name)
            if isinstance(value, (int, float)) and value >= 0:
                self.recovery.labels(phase, kind).observe(float(value))

    def _on_checkpoint_written(self, event: Mapping[str, Any]) -> None:
        self.checkpoint_time.set(float(event.get("time") or self._clock()))
        for gauge, name in ((self.checkpoint_step, "step"), (self.checkpoint_bytes, "bytes"),
                            (self.checkpoint_write_seconds, "seconds")):
            if isinstance(event.get(name), (int, float)):
                gauge.set(event[name])

    def _on_checkpoint_failed(self, event: Mapping[str, Any]) -> None:
        self.checkpoint_failures.inc()

    def _on_resharded(self, event: Mapping[str, Any]) -> None:
        worker, round_number = event.get("worker") or f"rank{event.get('rank')}", event.get("round") or 0
        if not isinstance(round_number, int):
            return
        first_of_round = all(r != round_number for r, _ in self._reshard.values())
        self._reshard[worker] = (round_number, dict(event))
        if first_of_round:
            self.reshards.labels(str(event.get("source"))).inc()
        if isinstance(event.get("received_bytes"), (int, float)):
            self.reshard_bytes.inc(event["received_bytes"])
        newest = max(r for r, _ in self._reshard.values())
        current = [e for r, e in self._reshard.values() if r == newest]
        self.reshard_seconds.set(max(float(e.get("seconds") or 0) for e in current))
        self.replica_bytes.set(sum(float(e.get("replica_bytes_per_commit") or 0) for e in current))
        self.replicas_held.set(sum(float(e.get("replicas_held_bytes") or 0) for e in current))

    def _on_step_times(self, event: Mapping[str, Any]) -> None:
        score = event.get("straggler_score")
        if isinstance(score, (int, float)) and event.get("worker"):
            self._set(self.straggler_score, event["worker"], event.get("rank"), score)

    def _on_straggler_detected(self, event: Mapping[str, Any]) -> None:
        if event.get("worker"):
            self.straggler_reports.labels(event["worker"]).inc()

    def _on_straggler_evicted(self, event: Mapping[str, Any]) -> None:
        self.straggler_evictions.inc()

    _HANDLERS = {
        "agent_started": _on_agent_started,
        "worker_started": _on_worker_started,
        "worker_exited": _on_worker_exited,
        "round_started": _on_round_started,
        "round_formed": _on_round_formed,
        "reform_done": _on_reform_done,
        "checkpoint_written": _on_checkpoint_written,
        "checkpoint_failed": _on_checkpoint_failed,
        "step_times": _on_step_times,
        "resharded": _on_resharded,
        "straggler_detected": _on_straggler_detected,
        "straggler_evicted": _on_straggler_evicted,
    }

    # -- helpers ---------------------------------------------------------------------------
    def _ours(self, member) -> bool:
        return self.member is None or member == self.member

    def _set_round(self, event: Mapping[str, Any]) -> None:
        round_number, world_size = event.get("round"), event.get("world_size")
        # Events of one host arrive in file order, but the coordinator's thread and the
        # workers write concurrently: never go back to an older round.
        if not isinstance(round_number, int) or round_number < self._round:
            return
        self._round = round_number
        self.round.set(round_number)
        if isinstance(world_size, int):
            self.world_size.set(world_size)

    def _per_worker_gauges(self) -> tuple[Gauge, ...]:
        return self.step_seconds, self.straggler_score, self.replica_lag

    def _set(self, gauge: Gauge, worker: str, rank, value: float) -> None:
        """Set the worker's series of ``gauge``; a worker whose rank changed moves its
        series to the new rank: a re-formation renumbers the ranks, and the score of the
        last window (a step time, until the next look) stays the worker's last known one.
        Dropping them instead left a renumbered survivor without a score until its next
        window, beside a survivor whose rank stayed and kept its own."""
        label = "" if rank is None else str(rank)
        old = self._ranks.get(worker)
        self._ranks[worker] = label
        if old is not None and old != label:
            for g in self._per_worker_gauges():
                try:
                    g.remove(worker, old)
                except KeyError:
                    pass
                if g is not gauge and (g, worker) in self._last:
                    g.labels(worker, label).set(self._last[(g, worker)])
        self._last[(gauge, worker)] = value
        gauge.labels(worker, label).set(value)
