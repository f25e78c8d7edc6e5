"""Can this host still reach its peers? Asked when the ring stalls; answered to etcd.

A host cut off from its peers but not from etcd keeps its lease, so no TTL ever
removes it, and every worker of the ring waits in a collective for a peer that
cannot answer (gloo notices only at --collective-timeout, and no reset arrives
from an unreachable host). The agents find out themselves:

* **when**: the probing thread reads its workers' progress marks every ``_POLL_S``
  (0.1 s; the hang watchdog's boards in shared memory: no I/O). A worker in the
  training function with no commit for ``max(floor, factor x its slowest commit
  interval)`` (0.4 s, 3x; 10 s before the worker's first interval, whose start-up
  and first steps are slow anyway) means the ring may be stuck. Probing is cheap
  and harmless, so this bound is far shorter than the hang watchdog's, which kills.
* **what**: a TCP connect to each peer agent's store port (the members of the
  current plan, and whoever this host found unreachable before), all at once, with
  ``rendezvous/liveness.py``'s probe: for ``timeout`` seconds (0.75), a fresh connect
  every ``resend_every`` (0.25) to those not yet heard, and an answer to any of them
  counts. Accepted or refused, the host answered: reachable. Only no answer at all
  to any of them counts as unreachable (in ``passes`` passes in a row; one by
  default): a lost SYN, one queued for up to 0.75 s behind a busy link, or a blip
  shorter than that is never reported, nor a busy host or a long step (a live
  host's kernel answers a SYN in well under a millisecond on a LAN, loaded or not,
  and the port is the agent's, not the workers'). A host that died hard (no power,
  no NIC: nothing refuses) is thus reported about 1.25 s after the ring stopped
  (issue 41: <= 2 s to the next step).
* **then**: the result goes to ``reach/<member-id>`` on our lease, written only
  when it changes; the coordinator decides who is left out
  (``rendezvous/reachability.py``). If the one we cannot reach is the coordinator,
  nobody would decide until its lease ran out: the agent's succession check is
  started as for a broken ring, and deposes it once its whole ring has named it
  (``rendezvous/succession.py``). While the last report names anybody, the
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
_POLL_S = 0.1  # between two looks at the workers' marks while nothing is being found out


class PeerProbe:
    """The agent's prober: it watches its workers' marks and probes its peers in a thread of its own."""

    def __init__(self, etcd: Etcd, participant: Participant, events: EventLog,
                 marks: Callable[[], Iterable[Marks]] = lambda: (),
                 on_unreachable: Callable[[int], None] = lambda round_: None,
                 *, floor: float = 0.4, factor: float = 3.0, first: float = 10.0, timeout: float = 0.75,
                 resend_every: float = 0.25, passes: int = 1, clock: Callable[[], float] = time.monotonic,
                 probe: Callable = probe):
        self._etcd = etcd
        self._keys = participant.keys
        self._member_id = participant.member.member_id
        self._participant = participant
        self._events = events
        self._marks = marks  # the watchdog's boards (Watchdog.marks), read from this thread
        self._on_unreachable = on_unreachable  # (round): the succession checks the coordinator
        self.floor, self.factor, self.first = floor, factor, first
        self.timeout, self.resend_every, self.passes = timeout, resend_every, passes
        self._clock = clock
        self._probe = probe  # liveness.probe; a test gives the answers
        self._stop = threading.Event()
        self._addresses: dict[str, tuple[str, int]] = {}  # member id -> (addr, store port)
        self._silent_for: dict[str, int] = {}  # member id -> passes in a row it gave no answer
        self._slow_told: Optional[tuple[int, tuple[str, ...]]] = None  # (round, peers) last said slow
        self._written: Optional[tuple[int, tuple[str, ...]]] = None  # (round, unreachable) in etcd
        self._thread = threading.Thread(target=self._run, name="elastic-peer-probe", daemon=True)

    def start(self) -> "PeerProbe":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def stalled(self, marks: Iterable[Marks]) -> bool:
        """Does any of our workers look stuck in its step?"""
        now = self._clock()
        return any(m.progress and m.beats and now - m.progress_at > self.bound(m.slowest) for m in marks)

    def bound(self, slowest: float) -> float:
        """Seconds without a commit after which a worker looks stalled."""
        return max(self.floor, self.factor * slowest) if slowest > 0 else max(self.floor, self.first)

    # -- the probing thread ---------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            searching = bool(self._written and self._written[1]) or bool(self._silent_for)
            if not searching and not self.stalled(self._marks()):
                self._stop.wait(_POLL_S)
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
        return bool(set(self._silent_for) - reported)

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
        took: dict[str, float] = {}
        answers = self._probe(addresses, self.timeout, self.resend_every, took=took)
        self._tell_slow(plan.round, took)
        silent = {m for m, answer in answers.items() if not reachable(answer)}
        self._silent_for = {m: self._silent_for.get(m, 0) + 1 for m in silent}
        confirmed = tuple(sorted(m for m, passes in self._silent_for.items() if passes >= self.passes))
        if silent - set(confirmed):
            return  # not silent long enough: asked again at once (_run) before anything is reported
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
        if confirmed:
            self._on_unreachable(plan.round)

    def _tell_slow(self, round_: int, took: dict[str, float]) -> None:
        """Peers that answered, but not their first connect's slot: a slow or lossy link
        (once per round for each set of them; nothing is decided on it)."""
        slow = tuple(sorted(m for m, seconds in took.items() if seconds > self.resend_every))
        if slow and (round_, slow) != self._slow_told:
            self._slow_told = (round_, slow)
            self._events.emit("peers_slow", round=round_, answered_after_s={m: round(took[m], 3) for m in slow})

    def _address(self, member_id: str) -> Optional[tuple[str, int]]:
        """A peer agent's (addr, store port), from its member record (cached)."""
        if member_id not in self._addresses:
            record = read_member(self._etcd, self._keys, member_id)
            if record is None:
                return None  # gone from the job, or unreadable (the coordinator names the key): nothing to reach
            self._addresses[member_id] = (record[0].addr, record[0].store_port)
        return self._addresses[member_id]
