"""A failed worker asking for its next round, and making sure somebody can answer."""

from __future__ import annotations

import logging
import threading
import time

from elastic.rendezvous import ControlChannel, Etcd, JobKeys, RendezvousError, evict_if_dead

from ..contract.worker_config import WorkerConfig

log = logging.getLogger(__name__)

# While waiting for the round after a failure: how long before we look for a dead
# coordinator, and how often we post our reset request again if etcd refused it.
NUDGE_AFTER_S = 1.0
NUDGE_EVERY_S = 2.0


class ResetNudge:
    """While a failed worker waits for its next round: post the reset request (again,
    if etcd refused it), and if no round comes, look for a dead coordinator.

    A coordinator whose host died keeps its election key until its lease expires
    (--rdzv-ttl). If its agent's port refuses connections, the agent is dead for
    sure, and revoking its lease now lets another agent lead at once.
    """

    def __init__(self, control: ControlChannel, etcd: Etcd, config: WorkerConfig, old_round: int, reason: str):
        self._control, self._etcd, self._config = control, etcd, config
        self._old_round = old_round
        self._reason = reason
        self._posted = False
        self._started = time.monotonic()
        self._next = self._started
        self._done = threading.Event()

    def start(self) -> "ResetNudge":
        """Nudge from a thread of our own until ``stop()``: the worker waits for its plan
        meanwhile. On the waiting thread, a request sent while etcd elected a new leader
        (the endpoint's host lost) held the plan, already written, for up to a second."""
        threading.Thread(target=self._run, name="elastic-reset-nudge", daemon=True).start()
        return self

    def stop(self) -> None:
        self._done.set()

    def _run(self) -> None:
        while not self._done.is_set():
            try:
                self()
            except Exception as exc:  # noqa: BLE001 - a nudge is a hint: the watch still delivers the plan
                log.warning("round %d: the reset request failed (%s)", self._old_round, exc)
            self._done.wait(self.next_in())

    def next_in(self) -> float:
        return max(0.0, self._next - time.monotonic())

    def __call__(self) -> None:
        now = time.monotonic()
        self._next = now + (NUDGE_AFTER_S if not self._posted else NUDGE_EVERY_S)
        try:
            if not self._posted:
                newest = self._control.plan
                if newest is None or newest.round <= self._old_round:
                    # No plan explains the failure (a hang, a partition): ask for one.
                    self._control.request_reset(self._config.worker_id, self._old_round, self._reason)
                self._posted = True
            elif now - self._started >= NUDGE_AFTER_S:
                coordinator = self._etcd.get(JobKeys(self._config.job_id).coordinator)
                if coordinator is not None:
                    evict_if_dead(self._etcd, JobKeys(self._config.job_id), coordinator.value.decode())
        except RendezvousError as exc:
            # etcd away or partitioned: the watch delivers the plan once it is back.
            log.info("round %d: etcd unreachable while asking for a new round (%s)", self._old_round, exc)
