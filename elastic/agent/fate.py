"""What becomes of a worker that exited: the agent's decision, as a pure function.

``fate(exit, view)`` reads the exit (status, signal), the record the worker left
(``contract/faults.py``: finished, or the fault that ended it) and the agent's view
(leaving? still wanted? job stopping? an elastic worker or a torchrun-style script?
restarts left? the same fault seen before?) and returns a ``Fate``; ``Agent._on_exit``
carries it out. The rules, in order:

* the agent is leaving, or no longer wants the worker: nothing to do;
* exit 0: the job succeeds only when the training function returned
  (``finished``), or when a torchrun-style script ended (it has no other end). An
  elastic worker that exits 0 otherwise (``os._exit(0)`` or ``sys.exit(0)``
  mid-training, a stop nobody decided) did not finish: it is a lost worker, replaced
  like a crash. A stop at the job's last commit, or a job already over, is the
  job's own ending;
* peers unreachable: a round of the network, nobody dropped (the budget is the agent's);
* an error in user code, the reset budget used up, or storage that cannot be read:
  the job fails, once (as the user's error only for the first);
* a broken process: replaced within ``--max-restarts``, unless the same fault (same
  kind, same line) hit every worker of this agent within ``SAME_FAULT_WINDOW_S``, or
  hits a replacement again: then
  it is deterministic (every rank out of memory at the same step) and every
  replacement would meet it, so the job fails at once, naming it;
* anything else (a crash, a signal, a broken ring that escaped ``@elastic.run``):
  an elastic worker is replaced; a torchrun-style script (or a Horovod script without
  ``hvd.elastic.run``) restarts every worker, a killed one too, as torchrun does, or with
  no restart left fails the job at once, naming it (never a wait for a replacement).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from elastic.rendezvous.control import CAUSE_USER_CODE

from ..contract.faults import BUDGET, NETWORK, PROCESS, STORAGE, USER, ExitRecord, Fault

IGNORE, SUCCEED, REPLACE, NETWORK_ROUND, FAIL, RESTART_PLAIN = (
    "ignore", "succeed", "replace", "network round", "fail", "restart plain",
)
CAUSE_USER = "user"
# Workers that meet one deterministic fault (every rank out of memory at step K) end
# within a second of each other: they run in lockstep. Minutes apart, the same line is
# more likely two separate faults.
SAME_FAULT_WINDOW_S = 120.0  # the cause of a failure in the user's code (the agent maps it to etcd's)


@dataclass(frozen=True)
class Exit:
    """A worker process that ended, as the agent saw it."""

    worker_id: str
    exit_code: Optional[int]  # None when killed by a signal
    signal: Optional[int] = None
    record: Optional[ExitRecord] = None  # what the worker said of its end, if anything


@dataclass(frozen=True)
class View:
    """What the agent knows that the exit does not say."""

    leaving: bool = False  # the agent withdraws its workers (SIGTERM)
    wanted: bool = True  # the worker is still one the agent offers the job
    job_ending: bool = False  # the job stops at a commit (every worker exits 0), or has ended
    elastic: bool = True  # the worker called elastic.init() (else a torchrun-style script)
    lost_reason: Optional[str] = None  # why the agent killed it (a hang), if it did
    replaced_fault: Optional[Fault] = None  # the fault of the worker this one replaced
    same_fault_workers: int = 1  # this agent's workers that ended with this exit's fault, this one included
    local_workers: int = 1  # the agent's workers (--nproc-per-node)


@dataclass(frozen=True)
class Fate:
    action: str  # IGNORE, SUCCEED, REPLACE, NETWORK_ROUND, FAIL, RESTART_PLAIN
    reason: str = ""  # the line logged and reported (the job's status for SUCCEED and FAIL)
    cause: str = ""  # FAIL: CAUSE_USER_CODE for an error in user code, else "" (sets every agent's exit status)


def fate(exit: Exit, view: View) -> Fate:
    """What to do about ``exit`` (see the module's docstring for the rules)."""
    worker, record = exit.worker_id, exit.record
    fault = record.fault if record is not None else None
    if view.leaving or not view.wanted:
        return Fate(IGNORE)
    if exit.exit_code == 0:
        if view.job_ending:
            return Fate(IGNORE)  # it stopped at the job's last commit, or left a job already over
        if (record is not None and record.finished and fault is None) or not view.elastic:
            return Fate(SUCCEED, f"worker {worker} finished")
        return _lost(exit, view, "exited 0 before its training function returned")
    if fault is not None and fault.kind == NETWORK:
        return Fate(NETWORK_ROUND, fault.reason)
    if fault is not None and fault.kind in (USER, BUDGET, STORAGE):
        return Fate(FAIL, f"worker {worker} failed: {fault.reason}", CAUSE_USER_CODE if fault.kind == USER else "")
    if fault is not None and fault.kind == PROCESS:
        if fault == view.replaced_fault:
            return Fate(FAIL, f"worker {worker} failed as the worker it replaced did: {fault.reason} "
                              f"(the same fault again: replacing it cannot help)")
        if view.local_workers > 1 and view.same_fault_workers >= view.local_workers:
            return Fate(FAIL, f"all {view.local_workers} workers of this host failed the same way: {fault.reason} "
                              f"(replacing them cannot help)")
        return _lost(exit, view, f"broken process: {fault.reason}")
    how = f"signal {exit.signal}" if exit.signal else f"exit code {exit.exit_code}"
    if not view.elastic:
        # A torchrun script that was killed, or exited with an error (most likely because
        # a peer died under it): restart every worker, as torchrun would. Its world is
        # fixed: a replacement alone would leave the others in a broken ring.
        return Fate(RESTART_PLAIN, _with_lost_reason(view, how))
    return _lost(exit, view, how)


def _lost(exit: Exit, view: View, how: str) -> Fate:
    return Fate(REPLACE, f"worker {exit.worker_id} died ({_with_lost_reason(view, how)})")


def _with_lost_reason(view: View, how: str) -> str:
    return f"{view.lost_reason}, {how}" if view.lost_reason else how


@dataclass
class FaultHistory:
    """The broken-process faults this agent's workers ended with, to tell one broken
    process (replace it) from a fault every process meets (fail the job)."""

    window_s: float = SAME_FAULT_WINDOW_S
    _ends: dict = field(default_factory=dict)  # Fault -> {worker id: when it ended (monotonic)}
    _replaced: dict = field(default_factory=dict)  # new worker id -> the fault of the one it replaced

    def ended(self, worker_id: str, fault: Optional[Fault], now: float) -> int:
        """Note that ``worker_id`` ended with ``fault`` at ``now``; how many workers
        ended with it within the window, this one included."""
        if fault is None or fault.kind != PROCESS:
            return 1
        ends = self._ends.setdefault(fault, {})
        ends[worker_id] = now
        for other, when in list(ends.items()):
            if now - when > self.window_s:
                del ends[other]
        return len(ends)

    def replaced(self, new_worker_id: str, fault: Optional[Fault]) -> None:
        if fault is not None:
            self._replaced[new_worker_id] = fault

    def replaced_fault(self, worker_id: str) -> Optional[Fault]:
        return self._replaced.get(worker_id)
