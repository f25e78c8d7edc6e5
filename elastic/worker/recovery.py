"""The recovery path, top to bottom: ``@elastic.run``.

    detect    a collective raises (or a commit says the ring changes)
    classify  a broken ring re-forms; a bug in user code fails this worker; a
              broken process (sticky CUDA error) exits for its agent to replace it
    budget    more than --max-resets failures within --reset-window fail it too
    abort     leave the except block, destroy the old group, collect its garbage
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
from dataclasses import dataclass
from typing import Callable, Optional, TypeVar

from ..contract.errors import (
    HostsUpdatedInterrupt,
    JobStopping,
    LeftJob,
    PeerDataInvalid,
    PeersUnreachable,
    ResetLimitExceeded,
)
from ..contract.console import FILE_ONLY
from ..contract.faults import NETWORK
from ..contract.reset_budget import ResetBudget
from . import exit_record, lifecycle
from .device_health import check_device
from .failures import classify, classify_in_window

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class _Interruption:
    reason: str
    failed: bool  # True: the ring broke, roll back; False: a planned switch at a commit
    detected: float  # monotonic time of detection
    stop: bool = False  # the job was told to stop: save the last commit and leave
    left: bool = False  # this worker is no longer part of the job (withdrawn, job over)
    unreachable: Optional[PeersUnreachable] = None  # the peers could not connect (no traceback kept)
    alone: bool = False  # a fault only this worker saw (a peer's or the store's bad value)


def run(func: Callable[..., T]) -> Callable[..., Optional[T]]:
    """Run ``func(state, ...)``; re-enter it on a new ring after every re-formation."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        runtime = lifecycle.current()
        budget = ResetBudget(runtime.max_resets, runtime.reset_window)
        finished_reform = None  # (interruption, times) of the re-formation being completed
        exit_record.training_started()  # from now on only a return is this worker's finish
        while True:
            interruption = _call(_resume, func, state, args, kwargs, runtime, finished_reform)
            if interruption is None:
                runtime.end_training()  # no more steps: the hang watchdog stops judging them
                state.flush_checkpoints(final=True)  # a graceful end leaves the last commit on disk
                exit_record.finished()  # the one ending its agent counts as the job's success
                return _result.pop()
            if interruption.left:
                _leave(runtime, interruption.reason)
            if interruption.stop:
                # Every worker stops at the same commit; rank 0 makes it durable first.
                state.flush_checkpoints(final=True)
                log.info("job stopped at a commit: %s", interruption.reason)
                runtime.shutdown()
                raise SystemExit(0)
            # -- we are outside the except block: the old ring can be freed now.
            if interruption.alone:
                # The peers sit in the ring's next operation, unaware: fail it for them
                # now rather than after the collective timeout.
                runtime.abort_ring()
            if interruption.failed:
                _spend(budget, runtime, interruption.reason, unreachable=interruption.unreachable)
                _check_and_restore(runtime, state)
            finished_reform = (interruption, _reform(runtime, interruption, budget))

    return wrapper


def _check_and_restore(runtime, state) -> None:
    """After a failure: the old ring aborted, this worker's own device checked, the last
    commit restored. A device that no longer answers would break the next ring too: this
    process exits WORKER_BROKEN instead (device_health.py, lifecycle.py)."""
    runtime.abort_device_ring()
    check_device(runtime.backend, runtime.config.collective_timeout if runtime.config else 60.0,
                 slot=runtime.local_rank)
    state.restore()


def _reform(runtime, interruption: _Interruption, budget: ResetBudget):
    """Re-rendezvous and build the next ring, trying again while re-forming fails."""
    reason, failed = interruption.reason, interruption.failed
    while True:
        outcome = _try_reform(runtime, reason, failed)
        if not isinstance(outcome, _ReformFailed):
            return outcome
        if outcome.left:
            _leave(runtime, outcome.reason)
        # The next ring broke while it formed (a peer died in init, etcd went away):
        # one more failure, whose new round the next attempt waits for.
        log.warning("round %d: re-forming failed (%s); trying the next round", runtime.round, outcome.reason,
                    extra=FILE_ONLY)
        _spend(budget, runtime, outcome.reason, unreachable=outcome.unreachable)
        reason, failed = outcome.reason, True


@dataclass(frozen=True)
class _ReformFailed:
    reason: str  # one line
    left: bool = False  # this worker is no longer part of the job
    unreachable: Optional[PeersUnreachable] = None  # the peers could not connect (no traceback kept)


def _try_reform(runtime, reason: str, failed: bool):
    """``runtime.reform``'s times, or a ``_ReformFailed`` saying why it failed (no
    exception object outlives this frame: it would pin the half-built group)."""
    try:
        return runtime.reform(reason, failed=failed)
    except LeftJob as exc:
        return _ReformFailed(str(exc), left=True)
    except Exception as exc:
        fault = classify(exc)
        if not fault.reforms:
            raise
        return _ReformFailed(fault.reason, unreachable=_detached(exc))


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


def _detached(exc: BaseException) -> Optional[PeersUnreachable]:
    """The peers-unreachable error without its traceback, to be raised again when the
    budget runs out (see ``_spend``); None for any other error."""
    return exc.detached() if isinstance(exc, PeersUnreachable) else None


def _resume(func, state, args, kwargs, runtime, finished_reform):
    """Bring the new ring to its newest commit, then (re-)enter the training function."""
    runtime.ensure_joined()  # a joiner arrives only now, ready to receive the state
    started_sync = time.monotonic()
    plan = state.sync()
    runtime.begin_round()
    state.on_reset()
    if finished_reform is not None:
        interruption, times = finished_reform
        done = time.monotonic()
        runtime.events.emit(
            "reform_done",
            worker=runtime.config.worker_id if runtime.config else None,
            world_size=runtime.world_size,
            failed=interruption.failed,
            reason=interruption.reason,
            detect_s=round(times.release_s, 4),
            rendezvous_s=round(times.rendezvous_s, 4),
            pg_init_s=round(times.pg_init_s, 4),
            sync_s=round(done - started_sync, 4),
            total_s=round(done - interruption.detected, 4),
            commit=getattr(state, "_commits", None),  # resumed from (the timeline counts steps re-run)
            sync_holders=len(plan.holders),
            sync_receivers=len(plan.receivers),
            received=runtime.rank in plan.receivers,
            pid=os.getpid(),
        )
    return func(state, *args, **kwargs)


def _ring_broken() -> Optional[str]:
    """Why the current ring is broken (aborted, or an error NCCL reported), or None."""
    try:
        runtime = lifecycle.current()
    except Exception:  # noqa: BLE001 - not under elastic.init(): no ring to ask
        return None
    probe = getattr(runtime, "ring_broken", None)
    return probe() if probe is not None else None


# The function's return value travels through here so that ``_call`` can return
# either "finished" or an interruption without keeping the exception alive.
_result: list = []


def _call(body, *args) -> Optional[_Interruption]:
    try:
        _result.append(body(*args))
        return None
    except JobStopping as exc:
        return _Interruption(str(exc), failed=False, detected=time.monotonic(), stop=True)
    except HostsUpdatedInterrupt as exc:
        return _Interruption(str(exc), failed=False, detected=time.monotonic())
    except LeftJob as exc:
        return _Interruption(str(exc), failed=False, detected=time.monotonic(), left=True)
    except Exception as exc:
        fault = classify_in_window(exc, _ring_broken())
        if not fault.reforms:
            raise  # this worker fails (a bug in user code, a broken process): lifecycle.py reports it
        # The whole text (gloo's spans lines) for the log file; reform_done is the console's line.
        whole = fault.reason if fault.kind == NETWORK else f"{type(exc).__name__}: {str(exc).strip()}"
        log.warning("ring broken: %s", whole, extra=FILE_ONLY)
        return _Interruption(fault.reason, failed=True, detected=time.monotonic(), unreachable=_detached(exc),
                             alone=isinstance(exc, PeerDataInvalid))

