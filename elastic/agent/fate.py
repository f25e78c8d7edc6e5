"""What becomes of a worker that exited: the agent's decision, as a pure function.

``fate(exit, view)`` reads the exit (status, signal), the record the worker left
(``contract/faults.py``: finished, or the fault that ended it) and the agent's view
(leaving? still wanted? job stopping? an elastic worker or a torchrun-style script?
and what the agent's budgets say: restarts left, this round's failure counted already,
network rounds within the window, the same fault seen before; ``budgets.py`` reads them
without spending) and returns a ``Fate``. Every decision to fail the job is made here;
``Agent`` carries the fate out and spends the budget it names. The rules, in order:

* the agent is leaving, or no longer wants the worker: nothing to do;
* exit 0: the job succeeds only when the training function returned
  (``finished``), or when a torchrun-style script ended (it has no other end). An
  elastic worker that exits 0 otherwise (``os._exit(0)`` or ``sys.exit(0)``
  mid-training, a stop nobody decided) did not finish: it is a lost worker, replaced
  like a crash. A stop at the job's last commit, or a job already over, is the
  job's own ending;
* peers unreachable: a round of the network, nobody dropped; each failed round counts
  once against ``--max-resets`` per ``--reset-window``, and beyond it the job fails;
* an error in user code, the reset budget used up, or storage that cannot be read:
  the job fails, once (as the user's error only for the first);
* a broken process: replaced, unless the same fault (same kind, same line) hit every
  worker of this agent within ``SAME_FAULT_WINDOW_S``, or hits a replacement again:
  then it is deterministic (every rank out of memory at the same step) and every
  replacement would meet it, so the job fails at once, naming it;
* a torchrun-style script (or a Horovod script without ``hvd.elastic.run``) that was
  killed or exited with an error: every worker restarts (torchrun's semantics: its world
  is fixed, so a replacement alone would leave the others in a broken ring), counted once
  per round against ``--max-restarts``; beyond it the job fails at once, naming it;
* anything else (a crash, a signal, a broken ring that escaped ``@elastic.run``): the
  worker is lost. It is replaced while ``--max-restarts`` allows, else only dropped (the
  job goes on with fewer workers while the coordinator's ``--min-np`` allows).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

from elastic.rendezvous.control import CAUSE_USER_CODE

from ..contract.faults import BUDGET, NETWORK, PROCESS, STORAGE, USER, ExitRecord, Fault

# Workers that meet one deterministic fault (every rank out of memory at step K) end
# within a second of each other: they run in lockstep. Minutes apart, the same line is
# more likely two separate faults.
SAME_FAULT_WINDOW_S = 120.0


class Action(Enum):
    """What the agent does about an exit (``Agent._carry_out`` matches every one)."""

    IGNORE = "ignore"  # nothing: the agent leaves, the job ends, or the round's failure was counted
    SUCCEED = "succeed"  # the job succeeded
    REPLACE = "replace"  # drop the worker and offer a new one in its place (spends a restart)
    DROP = "drop"  # drop the worker, no replacement: --max-restarts is used up
    NETWORK_ROUND = "network round"  # ask for another round, nobody dropped (spends a network round)
    RESTART_PLAIN = "restart plain"  # torchrun's semantics: ask for a round that restarts every worker
    NOTED = "noted"  # a torchrun-style failure of a round already counted: told, nothing more
    FAIL = "fail"  # the job fails


IGNORE, SUCCEED, REPLACE, DROP = Action.IGNORE, Action.SUCCEED, Action.REPLACE, Action.DROP
NETWORK_ROUND, RESTART_PLAIN, NOTED, FAIL = Action.NETWORK_ROUND, Action.RESTART_PLAIN, Action.NOTED, Action.FAIL


@dataclass(frozen=True)
class Exit:
    """A worker process that ended, as the agent saw it."""

    worker_id: str
    exit_code: Optional[int]  # None when killed by a signal
    signal: Optional[int] = None
    record: Optional[ExitRecord] = None  # what the worker said of its end, if anything

    @property
    def fault(self) -> Optional[Fault]:
        return self.record.fault if self.record is not None else None


@dataclass(frozen=True)
class Standing:
    """What the agent's budgets say about one exit, read before anything is spent."""

    restarts_left: int = 1  # of --max-restarts
    max_restarts: int = 1
    plain_round_counted: bool = False  # this torchrun-style round's failure was counted already
    network_round_counted: bool = False  # this round's failure to connect was counted already
    network_rounds: int = 1  # rounds that failed to connect within --reset-window, this one included
    max_resets: int = 20
    reset_window: float = 3600.0
    replaced_fault: Optional[Fault] = None  # the fault of the worker this one replaced
    same_fault_workers: int = 1  # this agent's workers that ended with this exit's fault, this one included


@dataclass(frozen=True)
class View:
    """What the agent knows that the exit does not say."""

    leaving: bool = False  # the agent withdraws its workers (SIGTERM)
    wanted: bool = True  # the worker is still one the agent offers the job
    job_ending: bool = False  # the job stops at a commit (every worker exits 0), or has ended
    elastic: bool = True  # the worker called elastic.init() (else a torchrun-style script)
    lost_reason: Optional[str] = None  # why the agent killed it (a hang), if it did
    local_workers: int = 1  # the agent's workers (--nproc-per-node)
    budget: Standing = Standing()


@dataclass(frozen=True)
class Fate:
    action: Action
    reason: str = ""  # the line logged and reported (the job's status for SUCCEED and FAIL)
    cause: str = ""  # FAIL: CAUSE_USER_CODE for an error in user code, else "" (sets every agent's exit status)


def fate(exit: Exit, view: View) -> Fate:
    """What to do about ``exit`` (see the module's docstring for the rules)."""
    worker, record, fault, budget = exit.worker_id, exit.record, exit.fault, view.budget
    if view.leaving or not view.wanted:
        return Fate(IGNORE)
    if exit.exit_code == 0:
        if view.job_ending:
            return Fate(IGNORE)  # it stopped at the job's last commit, or left a job already over
        if (record is not None and record.finished and fault is None) or not view.elastic:
            return Fate(SUCCEED, f"worker {worker} finished")
        return _lost(exit, view, "exited 0 before its training function returned")
    if fault is not None and fault.kind == NETWORK:
        if budget.network_round_counted:
            return Fate(IGNORE)  # the round's other workers say the same
        if budget.network_rounds > budget.max_resets:
            return Fate(FAIL, f"{fault.reason} ({budget.network_rounds} rounds within {budget.reset_window:g}s, "
                              f"--max-resets {budget.max_resets} per --reset-window)")
        return Fate(NETWORK_ROUND, fault.reason)
    if fault is not None and fault.kind in (USER, BUDGET, STORAGE):
        return Fate(FAIL, f"worker {worker} failed: {fault.reason}", CAUSE_USER_CODE if fault.kind == USER else "")
    if fault is not None and fault.kind == PROCESS:
        if fault == budget.replaced_fault:
            return Fate(FAIL, f"worker {worker} failed as the worker it replaced did: {fault.reason} "
                              f"(the same fault again: replacing it cannot help)")
        if view.local_workers > 1 and budget.same_fault_workers >= view.local_workers:
            return Fate(FAIL, f"all {view.local_workers} workers of this host failed the same way: {fault.reason} "
                              f"(replacing them cannot help)")
        return _lost(exit, view, f"broken process: {fault.reason}")
    how = f"signal {exit.signal}" if exit.signal else f"exit code {exit.exit_code}"
    if not view.elastic:
        # A torchrun script that was killed, or exited with an error (most likely because
        # a peer died under it): restart every worker, as torchrun would, once per round.
        # Its world is fixed: a replacement alone would leave the others in a broken ring.
        died = f"worker {worker} died ({_with_lost_reason(view, how)})"
        if budget.plain_round_counted:
            return Fate(NOTED, died)
        if budget.restarts_left <= 0:
            return Fate(FAIL, f"{died}; --max-restarts {budget.max_restarts} used up")
        return Fate(RESTART_PLAIN, died)
    return _lost(exit, view, how)


def _lost(exit: Exit, view: View, how: str) -> Fate:
    reason = f"worker {exit.worker_id} died ({_with_lost_reason(view, how)})"
    return Fate(REPLACE if view.budget.restarts_left > 0 else DROP, reason)


def _with_lost_reason(view: View, how: str) -> str:
    return f"{view.lost_reason}, {how}" if view.lost_reason else how
