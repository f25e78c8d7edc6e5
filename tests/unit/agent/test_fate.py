"""The fate of an exited worker, as a table: the exit, its record and the agent's view in,
one decision out; no processes, no etcd."""

from __future__ import annotations

import signal

import pytest

from elastic.agent.budgets import FaultHistory
from elastic.agent.fate import (
    DROP,
    FAIL,
    IGNORE,
    NETWORK_ROUND,
    NOTED,
    REPLACE,
    RESTART_PLAIN,
    SUCCEED,
    Action,
    Exit,
    Fate,
    Standing,
    View,
    fate,
)
from elastic.contract.exit_codes import WORKER_BROKEN
from elastic.contract.faults import BUDGET, NETWORK, PROCESS, RING, STORAGE, USER, ExitRecord, Fault
from elastic.rendezvous.control import CAUSE_USER_CODE

FINISHED = ExitRecord(finished=True)
OOM = Fault(PROCESS, "OutOfMemoryError: out of memory at step 7")


def _failed(kind: str, reason: str) -> ExitRecord:
    return ExitRecord(fault=Fault(kind, reason))


CASES = [
    # -- exit 0: success only when the training function returned
    ("finished", Exit("w0", 0, record=FINISHED), View(), Fate(SUCCEED, "worker w0 finished")),
    ("a torchrun script's end", Exit("w0", 0), View(elastic=False), Fate(SUCCEED, "worker w0 finished")),
    ("exit 0 mid-training", Exit("w0", 0), View(),
     Fate(REPLACE, "worker w0 died (exited 0 before its training function returned)")),
    ("exit 0 with a fault", Exit("w0", 0, record=_failed(USER, "ValueError: x")), View(),
     Fate(REPLACE, "worker w0 died (exited 0 before its training function returned)")),
    ("stopped at the job's last commit", Exit("w0", 0), View(job_ending=True), Fate(IGNORE)),
    ("left a job already over", Exit("w0", 0), View(job_ending=True), Fate(IGNORE)),
    ("finished while the agent leaves", Exit("w0", 0, record=FINISHED), View(leaving=True), Fate(IGNORE)),
    ("withdrawn (a straggler evicted)", Exit("w0", 0), View(wanted=False), Fate(IGNORE)),
    # -- the worker's own record of a fault
    ("peers unreachable", Exit("w0", 1, record=_failed(NETWORK, "round 2: could not connect")), View(),
     Fate(NETWORK_ROUND, "round 2: could not connect")),
    ("an error in user code", Exit("w0", 1, record=_failed(USER, "ValueError: bad batch")), View(),
     Fate(FAIL, "worker w0 failed: ValueError: bad batch", CAUSE_USER_CODE)),
    ("the reset budget used up", Exit("w0", 1, record=_failed(BUDGET, "ResetLimitExceeded: 3 times")), View(),
     Fate(FAIL, "worker w0 failed: ResetLimitExceeded: 3 times", "")),
    ("checkpoints that cannot be read", Exit("w0", 1, record=_failed(STORAGE, "CheckpointsUnreadable: EIO")),
     View(), Fate(FAIL, "worker w0 failed: CheckpointsUnreadable: EIO", "")),
    ("a broken process", Exit("w0", WORKER_BROKEN, record=ExitRecord(fault=OOM)), View(local_workers=4),
     Fate(REPLACE, f"worker w0 died (broken process: {OOM.reason})")),
    ("a broken ring that escaped @run", Exit("w0", 1, record=_failed(RING, "DistNetworkError: reset")), View(),
     Fate(REPLACE, "worker w0 died (exit code 1)")),
    ("user error while the agent leaves", Exit("w0", 1, record=_failed(USER, "ValueError: x")), View(leaving=True),
     Fate(IGNORE)),
    # -- the same fault again: deterministic, replacing cannot help
    ("every worker of the host out of memory", Exit("w3", WORKER_BROKEN, record=ExitRecord(fault=OOM)),
     View(local_workers=4, budget=Standing(same_fault_workers=4)),
     Fate(FAIL, f"all 4 workers of this host failed the same way: {OOM.reason} (replacing them cannot help)")),
    ("three of four out of memory", Exit("w2", WORKER_BROKEN, record=ExitRecord(fault=OOM)),
     View(local_workers=4, budget=Standing(same_fault_workers=3)), Fate(REPLACE, f"worker w2 died (broken process: {OOM.reason})")),
    ("one worker per host is never 'all'", Exit("w0", WORKER_BROKEN, record=ExitRecord(fault=OOM)),
     View(local_workers=1, budget=Standing(same_fault_workers=1)), Fate(REPLACE, f"worker w0 died (broken process: {OOM.reason})")),
    ("a replacement meets its predecessor's fault", Exit("w4", WORKER_BROKEN, record=ExitRecord(fault=OOM)),
     View(budget=Standing(replaced_fault=OOM)),
     Fate(FAIL, f"worker w4 failed as the worker it replaced did: {OOM.reason} "
                "(the same fault again: replacing it cannot help)")),
    ("a replacement meets another fault", Exit("w4", WORKER_BROKEN, record=_failed(PROCESS, "AcceleratorError: x")),
     View(budget=Standing(replaced_fault=OOM)), Fate(REPLACE, "worker w4 died (broken process: AcceleratorError: x)")),
    # -- no record: a crash
    ("killed by a signal", Exit("w0", None, signal.SIGKILL), View(), Fate(REPLACE, "worker w0 died (signal 9)")),
    ("killed as hung", Exit("w0", None, signal.SIGKILL), View(lost_reason="hung 30s"),
     Fate(REPLACE, "worker w0 died (hung 30s, signal 9)")),
    ("exit 70 without a record", Exit("w0", WORKER_BROKEN), View(), Fate(REPLACE, "worker w0 died (exit code 70)")),
    ("a torchrun script killed", Exit("w0", None, signal.SIGKILL), View(elastic=False),
     Fate(RESTART_PLAIN, "worker w0 died (signal 9)")),
    # -- the restart budget (--max-restarts)
    ("lost with no restart left", Exit("w0", None, signal.SIGKILL), View(budget=Standing(restarts_left=0)),
     Fate(DROP, "worker w0 died (signal 9)")),
    ("a broken process with no restart left", Exit("w0", WORKER_BROKEN, record=ExitRecord(fault=OOM)),
     View(budget=Standing(restarts_left=0)), Fate(DROP, f"worker w0 died (broken process: {OOM.reason})")),
    # -- torchrun semantics: every worker restarts, once per round, within --max-restarts
    ("a torchrun script's error", Exit("w0", 1), View(elastic=False),
     Fate(RESTART_PLAIN, "worker w0 died (exit code 1)")),
    ("its round's restart already asked for", Exit("w1", 1), View(elastic=False,
                                                                  budget=Standing(plain_round_counted=True)),
     Fate(NOTED, "worker w1 died (exit code 1)")),
    ("a torchrun script's error, restarts used up", Exit("w0", 1),
     View(elastic=False, budget=Standing(restarts_left=0, max_restarts=2)),
     Fate(FAIL, "worker w0 died (exit code 1); --max-restarts 2 used up")),
    # -- rounds that could not connect: --max-resets per --reset-window, each round once
    ("its round already counted", Exit("w1", 1, record=_failed(NETWORK, "round 2: could not connect")),
     View(budget=Standing(network_round_counted=True)), Fate(IGNORE)),
    ("one round too many in the window", Exit("w0", 1, record=_failed(NETWORK, "round 9: could not connect")),
     View(budget=Standing(network_rounds=3, max_resets=2, reset_window=60.0)),
     Fate(FAIL, "round 9: could not connect (3 rounds within 60s, --max-resets 2 per --reset-window)")),
    ("the last round the window allows", Exit("w0", 1, record=_failed(NETWORK, "round 9: could not connect")),
     View(budget=Standing(network_rounds=2, max_resets=2)), Fate(NETWORK_ROUND, "round 9: could not connect")),
]


@pytest.mark.parametrize("exit, view, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_fate(exit, view, expected):
    assert fate(exit, view) == expected


def test_every_action_is_one_the_agent_carries_out():
    # Agent._carry_out matches each Action and raises on any other: a new action without
    # a case there is loud. The table above reaches every one.
    assert {c[3].action for c in CASES} == set(Action)


def test_the_history_counts_one_fault_on_distinct_workers_within_the_window():
    history = FaultHistory(window_s=60.0)

    def ended(worker, fault, now):
        counted = history.same_fault_workers(worker, fault, now)  # reading it notes nothing
        assert history.same_fault_workers(worker, fault, now) == counted
        history.ended(worker, fault, now)
        return counted

    assert ended("w0", OOM, now=0.0) == 1
    assert ended("w0", OOM, now=1.0) == 1  # the same worker twice is one worker
    assert ended("w1", OOM, now=2.0) == 2
    assert ended("w2", Fault(PROCESS, "AcceleratorError: x"), now=3.0) == 1  # another line
    assert ended("w3", OOM, now=200.0) == 1  # the others are long ago
    assert ended("w4", Fault(USER, "ValueError"), now=201.0) == 1  # only broken processes count


def test_the_history_remembers_what_a_replacement_replaced():
    history = FaultHistory()
    history.replaced("w4", OOM)
    history.replaced("w5", None)  # a crash without a fault
    assert history.replaced_fault("w4") == OOM
    assert history.replaced_fault("w5") is None and history.replaced_fault("w0") is None
