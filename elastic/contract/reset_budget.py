"""How many re-formations a job survives: a budget per time window.

``--max-resets N`` used to count re-formations over the process's whole life, so
a week-long job failed at its 21st failure however far apart the failures were.
What the option protects against is a ring that keeps breaking (a bad host, a
bug in the network stack), which shows as many failures close together. So the
budget is N re-formations within any ``--reset-window`` seconds: failures older
than the window no longer count.

Two counters use it: each worker (``recovery.py``: its ring re-formed) and each
agent (``agent/budgets.py``: rounds whose workers could not connect to each other).
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

    def count_if_spent(self, now: Optional[float] = None) -> int:
        """How many re-formations the window would hold if one were spent at ``now``;
        spends nothing (the agent decides first, then spends: agent/budgets.py)."""
        now = self.clock() if now is None else now
        return sum(1 for when in self._spent if now - when < self.window_s) + 1

    @property
    def recent(self) -> int:
        """Re-formations counted in the current window (after the last ``spend``)."""
        return len(self._spent)
