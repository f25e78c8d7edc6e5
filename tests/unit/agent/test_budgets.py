"""The agent's budgets as one object: read for a fate without spending, then spent as the fate says.

Driven the way the agent drives them (``Agent._on_exit``): a ``Charge`` per exit, its
``standing`` into ``fate``, then ``spend``. No processes, no etcd.
"""

from __future__ import annotations

import signal

from elastic.agent.budgets import AgentBudgets, Charge
from elastic.agent.fate import DROP, FAIL, IGNORE, NETWORK_ROUND, NOTED, REPLACE, RESTART_PLAIN, Exit, View, fate
from elastic.contract.faults import NETWORK, PROCESS, ExitRecord, Fault


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _decide(budgets: AgentBudgets, exit: Exit, now: float, *, network_round: int = 1, plain_round: int = 1,
            elastic: bool = True, local_workers: int = 1, replacement: str = None):
    charge = Charge.of(exit, network_round=network_round, plain_round=plain_round, now=now)
    decided = fate(exit, View(elastic=elastic, local_workers=local_workers, budget=budgets.standing(charge)))
    budgets.spend(decided, charge, replacement=replacement if decided.action == REPLACE else None)
    return decided


def test_the_agent_fails_the_job_only_when_unreachable_rounds_crowd_one_window():
    clock = _Clock()
    budgets = AgentBudgets(max_restarts=0, max_resets=1, reset_window=60.0, clock=clock)

    def fail_round(number: int, workers: int = 2) -> list:
        reason = f"round {number}: could not connect"
        return [_decide(budgets, Exit(f"m.w{w}", 1, record=ExitRecord(fault=Fault(NETWORK, reason))), clock.now,
                        network_round=number).action for w in range(workers)]

    for number in range(1, 6):  # five failed rounds, two minutes apart: each asks for a round, once
        assert fail_round(number) == [NETWORK_ROUND, IGNORE], number
        clock.now += 120.0
    assert fail_round(6) == [NETWORK_ROUND, IGNORE]
    clock.now += 5.0
    reason = "round 7: could not connect"
    failed = _decide(budgets, Exit("m.w0", 1, record=ExitRecord(fault=Fault(NETWORK, reason))), clock.now,
                     network_round=7)  # the second within a minute
    assert (failed.action, failed.reason) == (FAIL, f"{reason} (2 rounds within 60s, --max-resets 1 per --reset-window)")
    # A stale report of an older round, or the round's other worker: failed once, not again.
    assert fail_round(7) == [IGNORE, IGNORE] and fail_round(5) == [IGNORE, IGNORE]


def test_restarts_are_spent_by_replacements_and_by_torchrun_rounds_once_each():
    budgets = AgentBudgets(max_restarts=2, max_resets=20, reset_window=3600.0)
    killed = Exit("m.w0", None, signal.SIGKILL)
    assert _decide(budgets, killed, 0.0, replacement="m.w2").action == REPLACE
    assert budgets.restarts == 1
    # A torchrun-style round: two workers fail; the round restarts once.
    assert _decide(budgets, Exit("m.w1", 1), 1.0, plain_round=3, elastic=False).action == RESTART_PLAIN
    assert _decide(budgets, Exit("m.w2", 1), 1.1, plain_round=3, elastic=False).action == NOTED
    assert budgets.restarts == 2 and budgets.plain_round_failed(3) and not budgets.plain_round_failed(4)
    # None left: a lost worker is dropped, a torchrun-style round fails the job.
    assert _decide(budgets, Exit("m.w3", None, signal.SIGKILL), 2.0).action == DROP
    failed = _decide(budgets, Exit("m.w4", 1), 3.0, plain_round=4, elastic=False)
    assert (failed.action, failed.reason) == (FAIL, "worker m.w4 died (exit code 1); --max-restarts 2 used up")
    assert budgets.restarts == 2


def test_a_replacement_that_meets_its_predecessors_fault_fails_the_job():
    budgets = AgentBudgets(max_restarts=5, max_resets=20, reset_window=3600.0)
    oom = ExitRecord(fault=Fault(PROCESS, "OutOfMemoryError: step 5"))
    assert _decide(budgets, Exit("m.w0", 70, record=oom), 0.0, replacement="m.w1").action == REPLACE
    assert _decide(budgets, Exit("m.w1", 70, record=oom), 10.0).action == FAIL


def test_every_worker_of_the_host_with_one_fault_fails_the_job_and_reading_counts_nothing():
    budgets = AgentBudgets(max_restarts=5, max_resets=20, reset_window=3600.0)
    oom = ExitRecord(fault=Fault(PROCESS, "OutOfMemoryError: step 5"))
    for _ in range(3):  # looked at again and again: still the first of two
        assert budgets.standing(Charge("m.w0", oom.fault, 1, 1, 0.0)).same_fault_workers == 1
    assert _decide(budgets, Exit("m.w0", 70, record=oom), 0.0, local_workers=2, replacement="m.w2").action == REPLACE
    assert _decide(budgets, Exit("m.w1", 70, record=oom), 0.5, local_workers=2).action == FAIL
