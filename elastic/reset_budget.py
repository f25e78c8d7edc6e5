"""How many re-formations a worker survives: a budget per time window.

``--max-resets N`` used to count re-formations over the process's whole life, so
a week-long job failed at its 21st failure however far apart the failures were.
What the option protects against is a ring that keeps breaking (a bad host, a
bug in the network stack), which shows as many failures close together. So the
budget is N re-formations within any ``--reset-window`` seconds: failures older
than the window no longer count.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Deque


@dataclass
class ResetBudget:
    limit: int  # re-formations allowed within any window
    window_s: float  # seconds a re-formation counts against the budget
    _spent: Deque[float] = field(default_factory=collections.deque, repr=False)

    def spend(self, now: float) -> bool:
        """Count one re-formation at monotonic time ``now``; False once over budget."""
        while self._spent and now - self._spent[0] >= self.window_s:
            self._spent.popleft()
        self._spent.append(now)
        return len(self._spent) <= self.limit

    @property
    def recent(self) -> int:
        """Re-formations counted in the current window (after the last ``spend``)."""
        return len(self._spent)
