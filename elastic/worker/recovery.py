"""The recovery path, top to bottom: ``@elastic.run``.

    detect    a collective raises (or a commit says the ring changes)
    classify  a broken ring re-forms; a bug in user code fails this worker; a
              broken process (sticky CUDA error) exits for its agent to replace it
    budget    more than --max-resets failures within --reset-window fail it too
    abort     leave the except block, shut the old ring's connections, drop its group
    check     on CUDA, a bounded device sync: a device that does not answer is a
              broken process
    restore   roll back to the last commit (only after a failure)
    re-rendezvous and re-form: wait for the next plan, build its process group;
              a failure while doing so (a peer dies during init, etcd is away, the
              round is superseded) is one more failure of the ring, never a user
              error: it is counted against the budget and the next round is tried
    sync      agree on the ring's newest commit; the workers that hold it move
              nothing, the others receive it striped across all of them
    resume    call the training function again

The order of "leave the except block, then destroy" matters: the exception's
traceback holds the user's frames, hence the old DDP wrapper and process group;
while it lives the old gloo sockets stay open and the peers that are still
blocked in the dead ring wait for the collective timeout instead of failing
at once. For the same reason ``_call`` and ``_try_reform`` turn exceptions into
plain values before the recovery path acts on them.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Callable, Optional, TypeVar, Union

from ..contract.errors import LeftJob, PeersUnreachable, ResetLimitExceeded
from ..contract.console import FILE_ONLY
from ..contract.reset_budget import ResetBudget
from . import exit_record, lifecycle
from .committable import Committable
from .device_health import check_device
from .outcome import Broken, Finished, Leave, Stop, Switch, broken_by, outcome_of

log = logging.getLogger(__name__)

T = TypeVar("T")


def run(func: Callable[..., T]) -> Callable[..., Optional[T]]:
    """Run ``func(state, ...)``; re-enter it on a new ring after every re-formation."""

    @functools.wraps(func)
    def wrapper(state: Committable, *args, **kwargs):
        runtime = lifecycle.current()
        budget = ResetBudget(runtime.max_resets, runtime.reset_window)
        finished_reform = None  # (interruption, times) of the re-formation being completed
        exit_record.training_started()  # from now on only a return is this worker's finish
        while True:
            outcome = outcome_of(_resume, func, state, args, kwargs, runtime, finished_reform)
            if isinstance(outcome, Finished):
                runtime.end_training()  # no more steps: the hang watchdog stops judging them
                state.flush_checkpoints(final=True)  # a graceful end leaves the last commit on disk
                exit_record.finished()  # the one ending its agent counts as the job's success
                return outcome.value
            if isinstance(outcome, Leave):
                _leave(runtime, outcome.reason)
            if isinstance(outcome, Stop):
                # Every worker stops at the same commit; rank 0 makes it durable first.
                state.flush_checkpoints(final=True)
                log.info("job stopped at a commit: %s", outcome.reason)
                runtime.shutdown()
                raise SystemExit(0)
            # -- we are outside the except block: the old ring can be freed now.
            if isinstance(outcome, Broken):
                if outcome.alone:
                    # The peers sit in the ring's next operation, unaware: fail it for them
                    # now rather than after the collective timeout.
                    runtime.abort_ring()
                _spend(budget, runtime, outcome.reason, unreachable=outcome.unreachable)
                _check_and_restore(runtime, state)
            finished_reform = (outcome, _reform(runtime, outcome, budget))

    return wrapper


def _check_and_restore(runtime, state) -> None:
    """After a failure: the old ring aborted, this worker's own device checked, the last
    commit restored. A device that no longer answers would break the next ring too: this
    process exits WORKER_BROKEN instead (device_health.py, lifecycle.py)."""
    runtime.abort_device_ring()
    check_device(runtime.backend, runtime.config.collective_timeout if runtime.config else 60.0,
                 slot=runtime.local_rank)
    state.restore()


def _reform(runtime, outcome: Union[Switch, Broken], budget: ResetBudget):
    """Re-rendezvous and build the next ring, trying again while re-forming fails."""
    reason, failed = outcome.reason, outcome.failed
    while True:
        attempt = _try_reform(runtime, reason, failed)
        if not isinstance(attempt, (Leave, Broken)):
            return attempt
        if isinstance(attempt, Leave):
            _leave(runtime, attempt.reason)
        # The next ring broke while it formed (a peer died in init, etcd went away):
        # one more failure, whose new round the next attempt waits for.
        log.warning("round %d: re-forming failed (%s); trying the next round", runtime.round, attempt.reason,
                    extra=FILE_ONLY)
        _spend(budget, runtime, attempt.reason, unreachable=attempt.unreachable)
        reason, failed = attempt.reason, True


def _try_reform(runtime, reason: str, failed: bool):
    """``runtime.reform``'s times, or the ``Leave``/``Broken`` that ended it (no
    exception object outlives this frame: it would pin the half-built group)."""
    try:
        return runtime.reform(reason, failed=failed)
    except LeftJob as exc:
        return Leave(str(exc))
    except Exception as exc:
        broken = broken_by(exc)
        if broken is None:
            raise
        return broken


def _spend(budget: ResetBudget, runtime, reason: str, unreachable: Optional[PeersUnreachable] = None) -> None:
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


def _leave(runtime, reason: str) -> None:
    log.info("worker leaves the job: %s", reason)
    runtime.shutdown()
    raise SystemExit(0)


def _resume(func, state, args, kwargs, runtime, finished_reform):
    """Bring the new ring to its newest commit, then (re-)enter the training function."""
    runtime.ensure_joined()  # a joiner arrives only now, ready to receive the state
    started_sync = time.monotonic()
    plan = state.sync()
    runtime.begin_round()
    state.on_reset()
    if finished_reform is not None:
        outcome, times = finished_reform
        done = time.monotonic()
        runtime.events.emit(
            "reform_done",
            worker=runtime.config.worker_id if runtime.config else None,
            world_size=runtime.world_size,
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
            received=runtime.rank in plan.receivers,
            pid=os.getpid(),
        )
    return func(state, *args, **kwargs)
