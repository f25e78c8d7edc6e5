"""Can this host still reach its peers? Asked when the ring stalls; answered to etcd.

A host cut off from its peers but not from etcd keeps its lease, so no TTL ever
removes it, and every worker of the ring waits in a collective for a peer that
cannot answer (gloo notices only at --collective-timeout, and no reset arrives
from an unreachable host). The agents find out themselves:

* **when**: the agent's loop hands over its workers' progress marks (``tick``,
  from the hang watchdog's boards: no extra I/O). A worker in the training
  function with no commit for ``max(floor, factor x its slowest commit interval)``
  (1 s, 3x; 10 s before the worker's first interval, whose start-up and first
  steps are slow anyway) means the ring may be stuck. Probing is cheap and
  harmless, so this bound is far shorter than the hang watchdog's, which kills.
* **what**: a TCP connect to each peer agent's store port (the members of the
  current plan, and whoever this host found unreachable before), all at once,
  ``timeout`` seconds each (1.5 s: a SYN lost once is sent again after 1 s), with
  ``rendezvous/liveness.py``'s probe. Accepted or refused, the host answered:
  reachable. Only no answer at all, in two passes in a row, counts as unreachable: a
  busy host or a long step is never reported (the agent's port is served by the
  agent, not by the workers).
* **then**: the result goes to ``reach/<member-id>`` on our lease, written only
  when it changes; the coordinator decides who is left out
  (``rendezvous/reachability.py``). While the last report names anybody, the
  probing goes on, every ``_PAUSE_S``, stalled or not: that is how an excluded
  host (and those that could not reach it) say when the link is back, and the
  excluded host's workers, who wait for a round including them, join again at
  the next commit.

The probing runs in its own thread: an unreachable peer costs ``timeout``
seconds per pass, which the agent's loop must not wait for. Whether the
coordinator's agent is dead is not asked here: the agent's succession check owns
that (``rendezvous/succession.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable, Optional

from elastic.rendezvous import Etcd, Participant, RendezvousError
from elastic.rendezvous.liveness import probe, reachable, read_member
from elastic.rendezvous.reachability import ReachReport

from ..contract.events import EventLog
from ..contract.progress import Marks

log = logging.getLogger(__name__)

_PAUSE_S = 0.5  # between two probe passes while there is something to find out


class PeerProbe:
    """The agent's prober: ``tick(marks)`` from the agent's loop, the rest in a thread."""

    def __init__(self, etcd: Etcd, participant: Participant, events: EventLog,
                 *, floor: float = 1.0, factor: float = 3.0, first: float = 10.0, timeout: float = 1.5,
                 clock: Callable[[], float] = time.monotonic, probe: Callable = probe):
        self._etcd = etcd
        self._keys = participant.keys
        self._member_id = participant.member.member_id
        self._participant = participant
        self._events = events
        self.floor, self.factor, self.first, self.timeout = floor, factor, first, timeout
        self._clock = clock
        self._probe = probe  # liveness.probe; a test gives the answers
        self._stalled = threading.Event()
        self._stop = threading.Event()
        self._addresses: dict[str, tuple[str, int]] = {}  # member id -> (addr, store port)
        self._silent_once: set = set()  # gave no answer in the last pass
        self._written: Optional[tuple[int, tuple[str, ...]]] = None  # (round, unreachable) in etcd
        self._thread = threading.Thread(target=self._run, name="elastic-peer-probe", daemon=True)

    def start(self) -> "PeerProbe":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._stalled.set()

    def tick(self, marks: Iterable[Marks]) -> None:
        """Agent's loop: does any of our workers look stuck in its step?"""
        now = self._clock()
        stuck = any(m.progress and m.beats and now - m.progress_at > self.bound(m.slowest) for m in marks)
        if stuck:
            self._stalled.set()
        else:
            self._stalled.clear()

    def bound(self, slowest: float) -> float:
        """Seconds without a commit after which a worker looks stalled."""
        return max(self.floor, self.factor * slowest) if slowest > 0 else max(self.floor, self.first)

    # -- the probing thread ---------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            searching = bool(self._written and self._written[1]) or bool(self._silent_once)
            if not searching and not self._stalled.wait(_PAUSE_S):
                continue
            try:
                self._probe_once()
            except RendezvousError as exc:
                log.info("peer probe: etcd unreachable (%s); trying again", exc)
            except Exception:  # never let the prober die: it is how we get back in
                log.exception("peer probe failed; trying again")
            if not self._unconfirmed():  # a silence is confirmed (or not) by a second pass at once
                self._stop.wait(_PAUSE_S)

    def _unconfirmed(self) -> bool:
        reported = set(self._written[1]) if self._written else set()
        return bool(self._silent_once - reported)

    def _probe_once(self) -> None:
        session = self._participant.session
        plan = self._participant.control.plan
        if plan is None or session is None or session.lost.is_set() or not session.alive:
            self._stop.wait(_PAUSE_S)
            return
        peers = [m for m in plan.member_order() if m != self._member_id]
        # Those we could not reach before, while they are still registered (read afresh:
        # one that left the job is nobody to wait for).
        outside = [m for m in self._written[1] if m not in peers] if self._written else []
        for member_id in outside:
            self._addresses.pop(member_id, None)
        addresses = {m: a for m in peers + outside if (a := self._address(m)) is not None}
        silent = {m for m, answer in self._probe(addresses, self.timeout).items() if not reachable(answer)}
        confirmed = tuple(sorted(silent & self._silent_once))  # silent twice in a row
        self._silent_once = silent
        if silent - set(confirmed):
            return  # silent once: asked again at once (_run) before anything is reported
        report = (plan.round, confirmed)
        if report == self._written:
            return
        before = set(self._written[1]) if self._written is not None else set()
        self._etcd.put(self._keys.reach_report(self._member_id),
                       ReachReport(self._member_id, *report).to_json(), lease=session.lease_id)
        self._written = report
        if set(confirmed) != before:
            self._events.emit("peers_unreachable" if confirmed else "peers_reachable", round=plan.round,
                              unreachable=list(confirmed), back=sorted(before - set(confirmed)))

    def _address(self, member_id: str) -> Optional[tuple[str, int]]:
        """A peer agent's (addr, store port), from its member record (cached)."""
        if member_id not in self._addresses:
            record = read_member(self._etcd, self._keys, member_id)
            if record is None:
                return None  # gone from the job, or unreadable (the coordinator names the key): nothing to reach
            self._addresses[member_id] = (record[0].addr, record[0].store_port)
        return self._addresses[member_id]
