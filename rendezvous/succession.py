"""Losing the coordinating host costs no more than losing another: its successor takes over at once.

One elected agent plans the rounds (coordinator.py). When another host is lost, the
coordinator proves that host's agent dead (its port refuses connections, liveness.py),
revokes its lease and plans the next round within a second. When the coordinator's own
host is lost, nobody did that: the survivors waited for its election key, on its lease,
to expire. On bare metal with no etcd of the user's that host is usually the endpoint's,
which holds etcd's leader too, and a new etcd leader renews every lease to its full TTL:
the key outlived the host by etcd's re-election plus a whole ``--rdzv-ttl``.

So when a survivor's ring breaks (its worker tells its agent, ``contract/agent_channel.py``,
or the agent saw one of its workers die), the agent checks the
coordinator: it reads who holds the election key, connects to that agent's port, and
only if the host refuses the connection (a TCP reset: the host is up and nothing listens
there, so the agent process is gone) it revokes the key's lease. The key goes with the
coordinator's member record, every agent campaigns, one leads and plans the round.

A coordinator whose host died hard (power, kernel, NIC) refuses nothing: a connect to it
times out, and its workers' peers wait in a collective that never ends rather than see
their ring break. Their agents' peer probes find it (``elastic/agent/peer_probe.py``),
report it unreachable, and start this same check. Its ring's word is the evidence then:

* a refusal proves death. A connect that times out, an unreachable network, any error,
  proves nothing alone: the partition may be on our side. A silent coordinator is deposed
  only when every other member of its ring (two at least) has reported it unreachable in
  that round while it has reported nothing, for ``OWN_REPORT_WAIT_S`` (a live one stalls
  with its ring and reports about as soon, then decides for itself:
  ``reachability.cut_off_from_its_ring``). Without that, it keeps its key until its TTL;
* a coordinator wrongly removed could not go on deciding anyway: every plan, status and
  notice it writes is fenced by its key's create revision (``CreateRevisionEquals``), and
  a new key has a new revision; its own watch on the key tells it it is deposed;
* checking costs one read and one connect per agent per ring failure, and stops as soon
  as a round answers the failure, the coordinator answers the connect, or the key goes.

This is the one mechanism for a dead coordinator, and the agent its one owner: the probe
and what its answers prove are ``liveness.py``'s, the revocation is ``liveness.revoke_member``.
What to do next is decided by the pure ``next_move`` (tested as a table); ``Succession``
carries it out in its own thread, so the agent's loop never waits on etcd or a connect.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from enum import Enum
from typing import Callable, Optional

from .errors import RendezvousError
from .keys import JobKeys
from .kv import Kv
from .liveness import (ACCEPTED, PROBE_TIMEOUT_S, SILENT, Answer, answer_of, proves_dead, read_member,
                       revoke_member)
from .reachability import ReachReport, cut_off_from_its_ring
from .rounds import RoundPlan

log = logging.getLogger(__name__)

CHECK_EVERY_S = 0.5  # between two looks while the coordinator gave no proof either way
# One try at each etcd call of a look. The coordinator's host is often etcd's leader's: a
# call sent while etcd elects another is held for the whole call timeout (5 s) even once
# the new leader is in, where a short try and another look half a second later is not.
CALL_DEADLINE_S = 1.0
# Once every other member of its ring names a silent coordinator, how long its own report
# of the round is waited for (it would be there by then if it were alive and reaching
# etcd: its workers stalled with ours), looking every EVIDENCE_LOOK_S meanwhile; also
# while some, not all, of its ring have named it.
OWN_REPORT_WAIT_S = 0.3
EVIDENCE_LOOK_S = 0.1



class Move(Enum):
    DONE = "done"  # nothing (left) to do
    PROBE = "probe"  # ask the leader's agent
    EVICT = "evict"  # revoke its lease
    RETRY = "retry"  # look again soon


DONE, PROBE, EVICT, RETRY = Move.DONE, Move.PROBE, Move.EVICT, Move.RETRY


@dataclass(frozen=True)
class SuccessionView:
    """What a survivor knows when it looks at the coordinator after its ring broke."""

    failed_round: int  # the round whose ring broke
    plan_round: int  # the newest plan's round (0: none)
    leader: Optional[str]  # the member holding the election key (None: nobody)
    me: str  # our member id
    answer: Optional[Answer]  # the leader's agent's answer to a connect (liveness.py); None: not asked
    elapsed: float  # seconds since the ring broke
    patience: float  # seconds to look for at all: a dead leader's lease decides by then (two TTLs, timeouts.py)
    # Seconds for which every other member of the ring has reported the leader unreachable
    # while it reported nothing (reachability.cut_off_from_its_ring); None: not so.
    cut_off_for: Optional[float] = None


def next_move(view: SuccessionView) -> Move:
    """What to do next about the coordinator (see the module's docstring)."""
    if view.plan_round > view.failed_round:
        return DONE  # a round answered the failure: the coordinator (whoever) is at work
    if view.leader is None or view.leader == view.me:
        return DONE  # vacant (every agent campaigns), or we lead: our coordinator answers
    if view.elapsed >= view.patience:
        return DONE  # a dead leader's lease has expired by now; a live one is not ours to judge
    if view.answer is None:
        return PROBE
    if proves_dead(view.answer):
        return EVICT  # the host is up and its agent is gone: nobody will ever renew that lease
    if view.answer is ACCEPTED:
        return DONE  # alive: planning the round is its job
    if view.cut_off_for is not None and view.cut_off_for >= OWN_REPORT_WAIT_S:
        return EVICT  # silent to its whole ring, and silent in etcd: dead, or cut off from everything
    return RETRY  # silent: no proof (a partition may be ours); ask again until its TTL or its ring decides


class Succession:
    """``ring_broke(round)`` from the agent; the checking runs in a thread of its own."""

    def __init__(self, etcd: Kv, keys: JobKeys, member_id: str, newest_plan: Callable[[], Optional[RoundPlan]],
                 patience: float, *, answer: Callable[[str, int, float], Answer] = answer_of,
                 clock: Callable[[], float] = time.monotonic):
        self._etcd, self._keys, self._member_id = etcd, keys, member_id
        self._newest_plan, self._patience = newest_plan, patience
        self._answer, self._clock = answer, clock
        self._broken: Optional[tuple[int, float]] = None  # (round, when) of the newest failure not yet checked
        self._cut_off_since: Optional[tuple[int, str, float]] = None  # (round, leader, when) its ring named it
        self._next_look_s = CHECK_EVERY_S
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastic-succession", daemon=True)

    def start(self) -> "Succession":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def ring_broke(self, round_: int) -> None:
        """Our ring broke in ``round_``, or stalled with peers our probe cannot reach."""
        with self._lock:
            if self._broken is None or round_ > self._broken[0]:
                self._broken = (round_, self._clock())
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                broken, self._broken = self._broken, None
            if broken is not None and not self._stop.is_set():
                self.check(*broken)

    def check(self, failed_round: int, since: float) -> Optional[Move]:
        """Look at the coordinator until there is nothing left to do; the last move."""
        move = None
        while not self._stop.is_set():
            try:
                move = self._look(failed_round, since)
            except RendezvousError as exc:  # etcd re-electing its leader, or away: look again
                log.info("round %d: cannot check the coordinator yet (%s)", failed_round, exc)
                move = RETRY
            if move in (DONE, EVICT):
                return move
            if self._stop.wait(self._next_look_s) or self._wake.is_set():
                return move  # stopping, or a newer failure: that one is checked next
        return move

    def _look(self, failed_round: int, since: float) -> Move:
        self._next_look_s = CHECK_EVERY_S
        key = self._etcd.get(self._keys.coordinator, retry_deadline=CALL_DEADLINE_S)
        plan = self._newest_plan()
        view = SuccessionView(failed_round, plan.round if plan is not None else 0,
                              None if key is None else key.value.decode(errors="replace"),
                              self._member_id, None, self._clock() - since, self._patience)
        if next_move(view) != PROBE:
            return next_move(view)
        record = read_member(self._etcd, self._keys, view.leader, retry_deadline=CALL_DEADLINE_S)
        if record is None:
            return RETRY  # no address to prove anything with (re-registering, or being removed)
        leader, _ = record
        # The ring's reports are read before the connect too: the connect of a silent
        # leader takes its whole timeout, which is then time its own report had to come
        # (and, once the ring has named it, no more than that).
        named = self._cut_off_for(plan, view.leader) is not None
        timeout = OWN_REPORT_WAIT_S if named else PROBE_TIMEOUT_S
        view = replace(view, answer=self._answer(leader.addr, leader.store_port, timeout))
        if view.answer is SILENT:
            view = replace(view, cut_off_for=self._cut_off_for(plan, view.leader))
        move = next_move(view)
        if move == EVICT:
            # The election key's lease (the leader's session's) is the one to revoke.
            evidence = "refuses connections" if view.answer is not SILENT else \
                "answers none of its ring, nor reported in etcd"
            why = f"round {failed_round}: the coordinator, {self._clock() - since:.2f}s after the ring broke"
            if not revoke_member(self._etcd, leader, key.lease, why, retry_deadline=CALL_DEADLINE_S,
                                 evidence=evidence):
                return RETRY
        return move

    def _cut_off_for(self, plan: Optional[RoundPlan], leader: str) -> Optional[float]:
        """Seconds the ring's reports have named the silent ``leader`` (None: they do not,
        or not all yet); looks again soon while they name it."""
        kvs, _ = self._etcd.get_prefix(self._keys.reach, retry_deadline=CALL_DEADLINE_S)
        reports = {}
        for kv in kvs:
            member = kv.key[len(self._keys.reach):]
            try:
                reports[member] = ReachReport.from_json(member, kv.value)
            except RendezvousError:
                continue  # unreadable: no evidence either way (the coordinator names such keys)
        if any(leader in r.unreachable for r in reports.values()):
            self._next_look_s = EVIDENCE_LOOK_S
        if plan is None or not cut_off_from_its_ring(plan, leader, reports):
            self._cut_off_since = None
            return None
        now = self._clock()
        if self._cut_off_since is None or self._cut_off_since[:2] != (plan.round, leader):
            self._cut_off_since = (plan.round, leader, now)
        return now - self._cut_off_since[2]
