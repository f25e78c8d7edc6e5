"""How many more failures the agent may absorb: its budgets and memories, in one object.

An exit's fate (``fate.py``) depends on what the agent has spent and seen before:

* **restarts** (``--max-restarts``): a lost worker replaced, or a round of torchrun-style
  workers restarted after one of them failed, spends one. A change of membership spends
  nothing, as torch's agent: "membership changes do not count as retries";
* **torchrun-style rounds**: every worker of a failed round exits, but the round is
  restarted (and a restart spent) once;
* **network rounds** (``--max-resets`` per ``--reset-window``, ``contract/reset_budget.py``):
  rounds whose workers could not connect to each other, each counted once however many of
  its workers report it; rounds only grow, so the newest counted is all it remembers;
* **faults seen** (``FaultHistory``): the broken-process faults the agent's workers ended
  with, to tell one broken process (replace it) from a fault every process meets.

``standing(charge)`` reads all four for one exit and changes nothing: it is the budget
half of ``fate.View``. ``spend(fate, charge)`` then spends what the decision took. The
agent holds one ``AgentBudgets``; nothing else counts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..contract.faults import PROCESS, Fault
from ..contract.reset_budget import ResetBudget
from .fate import FAIL, NETWORK_ROUND, REPLACE, RESTART_PLAIN, SAME_FAULT_WINDOW_S, Exit, Fate, Standing


@dataclass(frozen=True)
class Charge:
    """One exit, as the budgets see it: whose, with which fault, in which rounds, when."""

    worker_id: str
    fault: Optional[Fault]
    network_round: int  # the round the agent acts on (the one whose workers could not connect)
    plain_round: int  # the round the worker was started for (a torchrun-style round's failure)
    now: float  # time.monotonic()

    @classmethod
    def of(cls, exit: Exit, *, network_round: int, plain_round: int, now: float) -> "Charge":
        return cls(exit.worker_id, exit.fault, network_round, plain_round, now)


@dataclass
class FaultHistory:
    """The broken-process faults this agent's workers ended with, to tell one broken
    process (replace it) from a fault every process meets (fail the job)."""

    window_s: float = SAME_FAULT_WINDOW_S
    _ends: dict = field(default_factory=dict)  # Fault -> {worker id: when it ended (monotonic)}
    _replaced: dict = field(default_factory=dict)  # new worker id -> the fault of the one it replaced

    def same_fault_workers(self, worker_id: str, fault: Optional[Fault], now: float) -> int:
        """How many workers ended with ``fault`` within the window, counting ``worker_id``
        as ending with it at ``now`` (nothing is noted: see ``ended``)."""
        if fault is None or fault.kind != PROCESS:
            return 1
        ends = self._ends.get(fault, {})
        return len({w for w, when in ends.items() if now - when <= self.window_s} | {worker_id})

    def ended(self, worker_id: str, fault: Optional[Fault], now: float) -> None:
        """Note that ``worker_id`` ended with ``fault`` at ``now``."""
        if fault is None or fault.kind != PROCESS:
            return
        ends = self._ends.setdefault(fault, {})
        ends[worker_id] = now
        for other, when in list(ends.items()):
            if now - when > self.window_s:
                del ends[other]

    def replaced(self, new_worker_id: str, fault: Optional[Fault]) -> None:
        if fault is not None:
            self._replaced[new_worker_id] = fault

    def replaced_fault(self, worker_id: str) -> Optional[Fault]:
        return self._replaced.get(worker_id)


class AgentBudgets:
    def __init__(self, max_restarts: int, max_resets: int, reset_window: float,
                 *, clock: Callable[[], float] = time.monotonic):
        self.max_restarts = max_restarts
        self.restarts = 0  # spent (TORCHELASTIC_RESTART_COUNT: worker_env.py)
        self.faults = FaultHistory()
        self._network = ResetBudget(max_resets, reset_window, clock=clock)
        self._network_round: Optional[int] = None  # the newest round counted
        self._plain_rounds: set[int] = set()

    def standing(self, charge: Charge) -> Standing:
        return Standing(
            restarts_left=self.max_restarts - self.restarts,
            max_restarts=self.max_restarts,
            plain_round_counted=self.plain_round_failed(charge.plain_round),
            network_round_counted=self._network_round is not None and charge.network_round <= self._network_round,
            network_rounds=self._network.count_if_spent(charge.now),
            max_resets=self._network.limit,
            reset_window=self._network.window_s,
            replaced_fault=self.faults.replaced_fault(charge.worker_id),
            same_fault_workers=self.faults.same_fault_workers(charge.worker_id, charge.fault, charge.now),
        )

    def spend(self, decided: Fate, charge: Charge, *, replacement: Optional[str] = None) -> None:
        """Spend what ``decided`` took; ``replacement``: the worker offered in its place."""
        self.faults.ended(charge.worker_id, charge.fault, charge.now)
        if decided.action == REPLACE:
            self.restarts += 1
            if replacement is not None:
                self.faults.replaced(replacement, charge.fault)
        elif decided.action == RESTART_PLAIN:
            self.restarts += 1
            self._plain_rounds.add(charge.plain_round)
        elif decided.action == NETWORK_ROUND:
            self._network_round = charge.network_round
            self._network.spend(charge.now)
        elif decided.action == FAIL:
            # Failed once: the round's other workers, reporting the same, fail nothing again.
            self._plain_rounds.add(charge.plain_round)
            self._network_round = max(charge.network_round, self._network_round or 0)

    def plain_round_failed(self, round_number: int) -> bool:
        """A torchrun-style worker of ``round_number`` failed (its peers restart anyway)."""
        return round_number in self._plain_rounds
