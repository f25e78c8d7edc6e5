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

Safety is the election's, unchanged:

* only a refusal proves death. A connect that times out, an unreachable network, any
  error, is no evidence: a coordinator cut off from us (the partition may be on our side)
  keeps its key until its TTL, exactly as before;
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
from .liveness import ACCEPTED, Answer, answer_of, proves_dead, read_member, revoke_member

log = logging.getLogger(__name__)

CHECK_EVERY_S = 0.5  # between two looks while the coordinator gave no proof either way
# One try at each etcd call of a look. The coordinator's host is often etcd's leader's: a
# call sent while etcd elects another is held for the whole call timeout (5 s) even once
# the new leader is in, where a short try and another look half a second later is not.
CALL_DEADLINE_S = 1.0



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
    return RETRY  # silent: no proof (a partition may be ours); ask again until its TTL decides


class Succession:
    """``ring_broke(round)`` from the agent; the checking runs in a thread of its own."""

    def __init__(self, etcd: Kv, keys: JobKeys, member_id: str, plan_round: Callable[[], int], patience: float,
                 *, answer: Callable[[str, int], Answer] = answer_of, clock: Callable[[], float] = time.monotonic):
        self._etcd, self._keys, self._member_id = etcd, keys, member_id
        self._plan_round, self._patience = plan_round, patience
        self._answer, self._clock = answer, clock
        self._broken: Optional[tuple[int, float]] = None  # (round, when) of the newest failure not yet checked
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
            if self._stop.wait(CHECK_EVERY_S) or self._wake.is_set():
                return move  # stopping, or a newer failure: that one is checked next
        return move

    def _look(self, failed_round: int, since: float) -> Move:
        key = self._etcd.get(self._keys.coordinator, retry_deadline=CALL_DEADLINE_S)
        view = SuccessionView(failed_round, self._plan_round(), None if key is None else key.value.decode(errors="replace"),
                              self._member_id, None, self._clock() - since, self._patience)
        if next_move(view) != PROBE:
            return next_move(view)
        record = read_member(self._etcd, self._keys, view.leader, retry_deadline=CALL_DEADLINE_S)
        if record is None:
            return RETRY  # no address to prove anything with (re-registering, or being removed)
        leader, _ = record
        move = next_move(replace(view, answer=self._answer(leader.addr, leader.store_port)))
        if move == EVICT:
            # The election key's lease (the leader's session's) is the one to revoke.
            why = f"round {failed_round}: the coordinator, {self._clock() - since:.2f}s after the ring broke"
            if not revoke_member(self._etcd, leader, key.lease, why, retry_deadline=CALL_DEADLINE_S):
                return RETRY
        return move
