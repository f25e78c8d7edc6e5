"""A failed worker asking for its next round, again while etcd refuses the request."""

from __future__ import annotations

import logging
import threading

from elastic.rendezvous import ControlChannel, RendezvousError

from ..contract.worker_config import WorkerConfig

log = logging.getLogger(__name__)

# While waiting for the round after a failure: how soon we post our reset request again
# when etcd refused it (a new etcd leader is elected within about a second).
RETRY_EVERY_S = 1.0


class ResetNudge:
    """While a failed worker waits for its next round: post the reset request, again
    while etcd refuses it. A dead coordinator is not the worker's to judge: its agent,
    told that the ring broke, checks it (``rendezvous/succession.py``)."""

    def __init__(self, control: ControlChannel, config: WorkerConfig, old_round: int, reason: str):
        self._control, self._config = control, config
        self._old_round = old_round
        self._reason = reason
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
                if self():
                    return
            except Exception as exc:  # noqa: BLE001 - a nudge is a hint: the watch still delivers the plan
                log.warning("round %d: the reset request failed (%s)", self._old_round, exc)
            self._done.wait(RETRY_EVERY_S)

    def __call__(self) -> bool:
        """Post the request unless a plan already explains the failure; True once done."""
        try:
            newest = self._control.plan
            if newest is None or newest.round <= self._old_round:
                # No plan explains the failure (a hang, a partition): ask for one.
                self._control.request_reset(self._config.worker_id, self._old_round, self._reason)
            return True
        except RendezvousError as exc:
            # etcd away or partitioned: the watch delivers the plan once it is back.
            log.info("round %d: etcd unreachable while asking for a new round (%s)", self._old_round, exc)
            return False
