"""The control channel: the few keys every agent and worker follows.

``control/plan`` (the newest round) and ``control/status`` (is the job still
running) are the only keys that everybody watches, so the traffic of a round is
one event per participant; ``control/waiting`` (waiting.py) is there only while
the job waits below min_np. Reset requests go the other way, to the coordinator.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from .errors import MalformedValueError, RendezvousError, parsing, text
from .etcd import CreateRevisionEquals, ModRevisionEquals, Put
from .keys import JobKeys
from .job_lease import lease_missing, parse_job_lease, put_on_job_lease
from .kv import Kv
from .rounds import RoundPlan
from .skipped import SkippedKeys
from .waiting import WaitingNotice

log = logging.getLogger(__name__)

RUNNING, STOPPING, SUCCEEDED, FAILED = "running", "stopping", "succeeded", "failed"

# Why a job failed, where it matters to whoever started it: an error in the user's
# training script (every agent then exits with the same distinct status, and a
# Kubernetes Job fails at once instead of retrying). Anything else leaves it empty.
CAUSE_USER_CODE = "user_code"

REQUEST_DEADLINE_S = 1.0  # one try at posting a reset request (request_reset)


@dataclass(frozen=True)
class JobStatus:
    state: str = RUNNING
    reason: str = ""
    # Wall-clock time the status was written (0: unknown), for people reading it later.
    since: float = field(default=0.0, compare=False)
    # CAUSE_USER_CODE or "" (not said: infrastructure, or a writer older than the field).
    cause: str = ""

    @property
    def over(self) -> bool:
        """No more training: succeeded or failed ("stopping" still runs to a commit)."""
        return self.state in (SUCCEEDED, FAILED)

    def to_json(self) -> bytes:
        obj = {"state": self.state, "reason": self.reason, "since": self.since or time.time()}
        if self.cause:  # written only when said: older readers ignore it, older writers omit it
            obj["cause"] = self.cause
        return json.dumps(obj).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "JobStatus":
        with parsing("job status"):
            obj = json.loads(data)
            state = text(obj["state"], "state")
            if state not in (RUNNING, STOPPING, SUCCEEDED, FAILED):
                raise ValueError(f"unknown state {state[:40]!r}")
            return cls(state, str(obj.get("reason", "")), float(obj.get("since", 0.0)), str(obj.get("cause", "")))


def _ended(value: bytes) -> bool:
    """Does this stored status say the job ended? A malformed one says nothing: a new
    status replaces it."""
    try:
        return JobStatus.from_json(value).over
    except MalformedValueError:
        return False


Listener = Callable[[Optional[RoundPlan], JobStatus], None]


class ControlChannel:
    def __init__(self, etcd: Kv, keys: JobKeys):
        self._etcd = etcd
        self._keys = keys
        self._cond = threading.Condition()
        self._plan: Optional[RoundPlan] = None
        self._status = JobStatus()
        self._waiting: Optional[tuple[WaitingNotice, float]] = None  # and when it arrived (monotonic)
        self._listeners: list[Listener] = []
        self._watch = None
        self._skipped = SkippedKeys("control")
        self._job_lease: Optional[int] = None  # job_lease.py: what the job's keys are put on

    # -- following ----------------------------------------------------------
    def start(self) -> "ControlChannel":
        self._reload()
        return self

    def _reload(self) -> None:
        kvs, revision = self._etcd.get_prefix(self._keys.control)
        with self._cond:
            self._waiting = None  # a full read: absent unless read below
            self._job_lease = None
            for kv in kvs:
                self._apply(kv.key, kv.value)
        if self._watch is not None:
            self._watch.cancel()
        self._watch = self._etcd.watch(
            self._keys.control,
            prefix=True,
            start_revision=revision + 1,
            on_events=self._on_events,
            on_reset=self._reload,
        )
        self._notify()

    def _apply(self, key: str, value: bytes) -> None:
        if not value:
            return
        try:
            if key == self._keys.plan:
                plan = RoundPlan.from_json(value)
                if self._plan is None or plan.round > self._plan.round:
                    self._plan = plan
            elif key == self._keys.status:
                self._status = JobStatus.from_json(value)
            elif key == self._keys.waiting:
                self._waiting = (WaitingNotice.from_json(value), time.monotonic())
            elif key == self._keys.job_lease:
                self._job_lease = parse_job_lease(value)
        except MalformedValueError as exc:
            # Kept as it was (no plan yet, the last status): the next good value wins.
            self._skipped.skip(key, value, exc)

    def _on_events(self, events) -> None:
        with self._cond:
            for event in events:
                if event.type == "put":
                    self._apply(event.kv.key, event.kv.value)
                elif event.kv.key == self._keys.waiting:
                    self._waiting = None
                elif event.kv.key == self._keys.job_lease:
                    self._job_lease = None
        self._notify()

    def _notify(self) -> None:
        with self._cond:
            plan, status = self._plan, self._status
            listeners = list(self._listeners)
            self._cond.notify_all()
        for listener in listeners:
            try:
                listener(plan, status)
            except Exception:  # a listener bug must not kill the watch thread
                log.exception("control listener failed")

    @property
    def plan(self) -> Optional[RoundPlan]:
        with self._cond:
            return self._plan

    @property
    def status(self) -> JobStatus:
        with self._cond:
            return self._status

    @property
    def job_lease(self) -> Optional[int]:
        """The job lease's id once a coordinator has taken one (None before: keys written
        then carry no lease, as they did before job leases)."""
        with self._cond:
            return self._job_lease

    @property
    def waiting(self) -> Optional[tuple[WaitingNotice, float]]:
        """The coordinator's notice of a wait below min_np, and when it arrived
        (``time.monotonic()``); None when the job is not waiting."""
        with self._cond:
            return self._waiting

    def add_listener(self, listener: Listener) -> None:
        with self._cond:
            self._listeners.append(listener)

    def wait_for(
        self,
        predicate: Callable[[Optional[RoundPlan], JobStatus], bool],
        timeout: Optional[float],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> bool:
        deadline = None if timeout is None else clock() + timeout
        with self._cond:
            while not predicate(self._plan, self._status):
                remaining = None if deadline is None else deadline - clock()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining if remaining is not None else 1.0)
            return True

    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    # -- speaking -----------------------------------------------------------
    def set_status(self, status: JobStatus, *, fence: Optional[tuple[str, int]] = None) -> bool:
        """Record the job's status; False if refused. True when written.

        An ended job (succeeded or failed) stays ended: the first end written wins,
        checked and written in one transaction (a failure written between our read
        and our write makes us read again). ``fence`` = (key, create revision) makes
        the write depend on that key too: a coordinator passes its election key and
        token, so once deposed it cannot write.
        """
        while True:
            current = self._etcd.get(self._keys.status)
            if current is not None and _ended(current.value):
                return False
            compare = [ModRevisionEquals(self._keys.status, 0 if current is None else current.mod_revision)]
            if fence is not None:
                compare.append(CreateRevisionEquals(*fence))
            try:
                written, _ = self._etcd.txn(compare, [Put(self._keys.status, status.to_json(), lease=self.job_lease)])
            except RendezvousError as exc:
                if not lease_missing(exc):
                    raise
                written, _ = self._etcd.txn(compare, [Put(self._keys.status, status.to_json())])
            if written:
                return True
            if fence is not None:
                holder = self._etcd.get(fence[0])
                if holder is None or holder.create_revision != fence[1]:
                    log.warning("status %s not written: %s no longer holds %s", status.state, fence[0], fence[1])
                    return False
            # The status changed under us: read it again.

    def request_reset(self, worker_id: str, round_number: int, reason: str, lost: tuple = ()) -> None:
        """Ask for a round after ``round_number``; ``lost`` names workers known dead.

        Tried for ``REQUEST_DEADLINE_S`` at most, then RendezvousError: every caller posts
        it again when refused (the worker's reset nudge, the agent's queued writes). A put
        sent while etcd re-elects its leader (its leader's host was lost) is held until
        the call's timeout even once a new leader is in, and a worker waiting for its next
        round must not post for that long (it cost 5 s, the call timeout, when the
        endpoint's host was lost)."""
        body = json.dumps({"round": round_number, "reason": reason[:500], "lost": list(lost)}).encode()
        put_on_job_lease(self._etcd, self._keys.request(worker_id), body, self.job_lease,
                         retry_deadline=REQUEST_DEADLINE_S)
