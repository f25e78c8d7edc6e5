"""Reports to etcd that must not be lost when etcd is away.

The agent reports what it sees (a worker died, the job succeeded or failed, this host
withdraws its workers) with etcd writes. During an outage, or while this host is cut
off, a write fails after its retries; the agent's loop must go on (its workers are
still running) and the report must still arrive. So a failed write is queued, and
the queue is flushed in order at every turn of the loop: an outage delays what we
report but loses nothing and keeps the order.
"""

from __future__ import annotations

import logging
from typing import Callable

from elastic.rendezvous import RendezvousError

log = logging.getLogger(__name__)


class EtcdWrites:
    def __init__(self) -> None:
        self._pending: list[tuple[str, Callable[[], object]]] = []

    def write(self, what: str, op: Callable[[], object]) -> None:
        """Run ``op`` now, or queue it behind earlier failed writes."""
        if self._pending:
            self._pending.append((what, op))  # keep the order of what we report
            return
        try:
            op()
        except RendezvousError as exc:
            log.warning("etcd unreachable (%s): will retry to %s", exc, what)
            self._pending.append((what, op))

    def flush(self) -> None:
        while self._pending:
            what, op = self._pending[0]
            try:
                op()
            except RendezvousError:
                return
            self._pending.pop(0)
            log.info("etcd is back: did %s", what)

    def __len__(self) -> int:
        return len(self._pending)
