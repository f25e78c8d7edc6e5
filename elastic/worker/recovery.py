"""The recovery path, top to bottom: ``@elastic.run``.

The loop holds the ring it trains on as a local variable (``ring``, a ``Ring``: one per
round, ``ring.py``); each turn runs the training function on it and ends with the next
ring. In the order the code runs:

    enter     a joiner enters its round now, at its first sync (the job's first ring
              formed at ``elastic.init()``)
    sync      the ring agrees on its newest commit; the workers that hold it move
              nothing, the others receive it striped across all of them
    resume    the ring begins (step log, watchdog, straggler windows), the reset
              callbacks run, the training function is called
    detect    a collective raises (or a commit says the ring changes: a switch, a stop)
    classify  a broken ring re-forms; a bug in user code fails this worker; a broken
              process (sticky CUDA error) exits for its agent to replace it
    abort     a fault only this worker saw (a peer's bad value): fail the peers'
              pending operations now, not at the collective timeout
    budget    more than --max-resets failures within --reset-window fail it too
    check     the ring's NCCL part aborted, then a bounded sync of this worker's
              device: one that does not answer is a broken process
    restore   roll back to the last commit
    leave     the old ring's connections shut and its group torn down (``Ring.leave``)
    ask       after a failure, a reset request, posted again while etcd refuses
    wait      for a plan after the old round that includes this worker
    re-form   the round's store, every worker's arrival there, the process group
              (``ring_entry.py``); a failure while doing so (a peer dies during init,
              etcd is away) is one more failure of the ring, never a user error: it
              is counted against the budget and the next round is tried
    then sync and resume again, on the new ring.

A planned switch (a join, a graceful leave) skips abort, budget, check and restore:
nothing is rolled back.

The order of "leave the except block, then tear down" matters: the exception's
traceback holds the user's frames, hence the old DDP wrapper and process group;
while it lives the old gloo sockets stay open and the peers that are still
blocked in the dead ring wait for the collective timeout instead of failing
at once. For the same reason ``outcome_of`` and ``_try_reform`` turn exceptions
into plain values before the recovery path acts on them.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional, TypeVar, Union

from ..contract.agent_channel import RingFormed, tell_agent
from ..contract.errors import LeftJob, PeersUnreachable, ResetLimitExceeded
from ..contract.console import FILE_ONLY
from ..contract.reset_budget import ResetBudget
from . import exit_record, lifecycle
from .committable import Committable
from .device_health import check_device
from .outcome import Broken, Finished, Leave, Stop, Switch, broken_by, outcome_of

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class ReformTimes:
    drop_s: float  # leave the old ring: destroy its group, free its sockets
    rendezvous_s: float  # wait for the next plan
    pg_init_s: float  # arrival barrier + process group, of which:
    store_s: float = 0.0  # connecting to the round's store
    arrive_s: float = 0.0  # waiting there for every worker of the round
    group_s: float = 0.0  # init_process_group (gloo: publish and read addresses, connect the mesh)


def run(func: Callable[..., T]) -> Callable[..., Optional[T]]:
    """Run ``func(state, ...)``; re-enter it on a new ring after every re-formation."""

    @functools.wraps(func)
    def wrapper(state: Committable, *args, **kwargs):
        session = lifecycle.current()
        budget = ResetBudget(session.config.max_resets, session.config.reset_window)
        exit_record.training_started()  # from now on only a return is this worker's finish
        ring, reformed = _first_ring(session, budget)  # enter
        while True:
            outcome = outcome_of(ring.broken_reason, _resume, func, state, ring, args, kwargs, reformed)
            if isinstance(outcome, Finished):
                session.end_training()  # no more steps: the hang watchdog stops judging them
                state.flush_checkpoints(ring, final=True)  # a graceful end leaves the last commit on disk
                exit_record.finished()  # the one ending its agent counts as the job's success
                return outcome.value
            if isinstance(outcome, Leave):
                _leave(session, outcome.reason)
            if isinstance(outcome, Stop):
                # Every worker stops at the same commit; rank 0 makes it durable first.
                state.flush_checkpoints(ring, final=True)
                log.info("job stopped at a commit: %s", outcome.reason)
                session.shutdown()
                raise SystemExit(0)
            # -- we are outside the except block: the old ring can be freed now.
            if isinstance(outcome, Broken):
                if outcome.alone:
                    # The peers sit in the ring's next operation, unaware: fail it for them
                    # now rather than after the collective timeout.
                    ring.abort()
                _spend(budget, outcome.reason, unreachable=outcome.unreachable)
                _check_and_restore(ring, state, session.config.collective_timeout)
            ring, reformed = _next_ring(session, ring, outcome, budget)

    return wrapper


def _resume(func, state, ring, args, kwargs, reformed):
    """Bring ``ring`` to its newest commit, then (re-)enter the training function."""
    started_sync = time.monotonic()
    plan = state.sync(ring)
    ring.begin()
    state.on_reset(ring)
    if reformed is not None:
        outcome, times = reformed
        done = time.monotonic()
        ring.events.emit(
            "reform_done",
            worker=ring.config.worker_id,
            world_size=ring.world_size,
            failed=outcome.failed,
            reason=outcome.reason,
            detect_s=round(times.drop_s, 4),
            rendezvous_s=round(times.rendezvous_s, 4),
            pg_init_s=round(times.pg_init_s, 4),
            pg_store_s=round(times.store_s, 4),
            pg_arrive_s=round(times.arrive_s, 4),
            pg_group_s=round(times.group_s, 4),
            sync_s=round(done - started_sync, 4),
            total_s=round(done - outcome.detected, 4),
            commit=getattr(state.commit_id, "count", None),  # resumed from (the timeline counts steps re-run)
            sync_holders=len(plan.holders),
            sync_receivers=len(plan.receivers),
            received=ring.rank in plan.receivers,
            pid=os.getpid(),
        )
        if outcome.failed:  # the coordinator holds a join round back until a survivor says this
            tell_agent(ring.config, RingFormed(ring.round))
    return func(state, *args, **kwargs)


def _check_and_restore(ring, state, collective_timeout: float) -> None:
    """After a failure: the ring's NCCL part aborted, this worker's own device checked, the
    last commit restored. A device that no longer answers would break the next ring too:
    this process exits WORKER_BROKEN instead (device_health.py, lifecycle.py)."""
    ring.abort_device()
    check_device(ring.backend, collective_timeout, slot=ring.local_rank)
    state.restore()


@dataclass(frozen=True)
class Formed:
    """A re-formation that succeeded: the new ring, and what each of its phases took."""

    ring: object  # ring.Ring
    times: ReformTimes


def _first_ring(session, budget: ResetBudget):
    """The ring the training function starts on, and (outcome, times) of the re-formation
    that made it (None when it formed at once)."""
    entry = session.entry
    if entry.formed is not None:
        return entry.formed, None  # the job's first round, formed at elastic.init()
    # A joiner: its round (or a newer one that includes it), now that it is ready to sync.
    attempt, tried = _try_reform(entry, None, entry.joining_plan, previous_plan=None, tried=0)
    if isinstance(attempt, Formed):
        return attempt.ring, None
    return _retry(session, attempt, attempt, tried, None, budget)


def _next_ring(session, ring, outcome: Union[Switch, Broken], budget: ResetBudget):
    """Leave ``ring`` and form the next one: the new ring, and (outcome, times) for its
    ``reform_done`` line."""
    entry = session.entry
    attempt, tried = _try_reform(entry, ring, lambda: entry.next_plan(ring.round, outcome.reason, failed=outcome.failed),
                                 previous_plan=ring.plan, tried=ring.round, failed=outcome.failed)
    if isinstance(attempt, Formed):
        return attempt.ring, (outcome, attempt.times)
    return _retry(session, outcome, attempt, tried, ring.plan, budget)


def _retry(session, outcome, attempt: Union[Leave, Broken], after: int, previous_plan, budget: ResetBudget):
    """Forming a ring failed (``attempt``): one more failure, spent from the budget; try
    the next round after ``after`` (the newest whose init began: re-entering it would
    re-use its store namespace, which hangs) while forming fails."""
    entry = session.entry
    while True:
        if isinstance(attempt, Leave):
            _leave(session, attempt.reason)
        # The next ring broke while it formed (a peer died in init, etcd went away).
        log.warning("round %d: re-forming failed (%s); trying the next round", after, attempt.reason,
                    extra=FILE_ONLY)
        _spend(budget, attempt.reason, unreachable=attempt.unreachable)
        reason = attempt.reason
        attempt, tried = _try_reform(entry, None, lambda: entry.next_plan(after, reason, failed=True),
                                     previous_plan=previous_plan, tried=after)
        if isinstance(attempt, Formed):
            return attempt.ring, (outcome, attempt.times)
        after = max(after, tried)


def _try_reform(entry, ring, next_plan: Callable[[], object], *, previous_plan, tried: int, failed: bool = True):
    """Leave ``ring`` (None: left already, or none), get the next plan (``next_plan()``: ask
    and wait), arrive at its store and form its group: ``Formed``, or the ``Leave``/``Broken``
    that ended it; with the newest round whose init began (``tried`` until one did). No
    exception object outlives this frame: it would pin the half-built group."""
    try:
        t0 = time.monotonic()
        if ring is not None:
            # A planned switch leaves together: nobody is blocked, no garbage to chase.
            ring.leave(failed)
        else:
            entry.leave_unformed(tried)
        t1 = time.monotonic()
        plan = next_plan()
        t2 = time.monotonic()
        arrival = entry.arrive(plan)
        tried = arrival.plan.round
        arrived = time.monotonic()
        new = entry.form(arrival, previous_plan)
        t3 = time.monotonic()
        return Formed(new, ReformTimes(t1 - t0, t2 - t1, t3 - t2, arrival.store_s, arrival.arrive_s, t3 - arrived)), tried
    except LeftJob as exc:
        return Leave(str(exc)), tried
    except Exception as exc:
        broken = broken_by(exc)
        if broken is None:
            raise
        return broken, tried


def _spend(budget: ResetBudget, reason: str, unreachable: Optional[PeersUnreachable] = None) -> None:
    if not budget.spend(time.monotonic()):
        if unreachable is not None:
            # The budget ran out on workers that cannot reach each other: a fault of the
            # network, whose rounds the agent counts against --max-resets itself. Exiting
            # as a user error (ResetLimitExceeded) would fail the job under the wrong reason.
            raise unreachable
        raise ResetLimitExceeded(
            f"ring re-formed {budget.recent - 1} times within {budget.window_s:g}s "
            f"(--max-resets {budget.limit} per --reset-window); last failure: {reason}"
        )


def _leave(session, reason: str) -> None:
    log.info("worker leaves the job: %s", reason)
    session.shutdown()
    raise SystemExit(0)
