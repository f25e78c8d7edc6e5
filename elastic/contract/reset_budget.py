"""How many re-formations a job survives: a budget per time window.

``--max-resets N`` used to count re-formations over the process's whole life, so
a week-long job failed at its 21st failure however far apart the failures were.
What the option protects against is a ring that keeps breaking (a bad host, a
bug in the network stack), which shows as many failures close together. So the
budget is N re-formations within any ``--reset-window`` seconds: failures older
than the window no longer count.

Two counters use it: each worker (``recovery.py``: its ring re-formed) and each
agent (``RoundFailures``: rounds whose workers could not connect to each other).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Callable, Deque, Optional


@dataclass
class ResetBudget:
    limit: int  # re-formations allowed within any window
    window_s: float  # seconds a re-formation counts against the budget
    # Where "now" comes from when ``spend`` is not told; a test passes a clock it moves.
    clock: Callable[[], float] = field(default=time.monotonic, repr=False, compare=False)
    _spent: Deque[float] = field(default_factory=collections.deque, repr=False)

    def spend(self, now: Optional[float] = None) -> bool:
        """Count one re-formation at monotonic time ``now`` (default: the clock's);
        False once over budget."""
        now = self.clock() if now is None else now
        while self._spent and now - self._spent[0] >= self.window_s:
            self._spent.popleft()
        self._spent.append(now)
        return len(self._spent) <= self.limit

    @property
    def recent(self) -> int:
        """Re-formations counted in the current window (after the last ``spend``)."""
        return len(self._spent)


class RoundFailures:
    """The agent's count of failed rounds: each round once, against a ``ResetBudget``.

    Every worker of a round whose ring could not connect reports it, so one failure
    arrives several times. Rounds only grow, so remembering the newest round counted
    is enough to tell a repeat (or a stale report of an older round, which the job has
    already moved past) from a new failure, and it stays one number however long the
    job runs, where a set of every failed round would grow for ever.
    """

    def __init__(self, budget: ResetBudget):
        self.budget = budget
        self._newest: Optional[int] = None

    def spend(self, round_number: int) -> Optional[bool]:
        """None if ``round_number`` was counted already; else count it and say whether
        the budget still holds."""
        if self._newest is not None and round_number <= self._newest:
            return None
        self._newest = round_number
        return self.budget.spend()

    @property
    def recent(self) -> int:
        """Failed rounds within the current window."""
        return self.budget.recent
