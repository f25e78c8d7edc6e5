"""Waiting below min_np, told on every agent's console.

While fewer than ``min_np`` workers are present, the coordinator fails the job after
``--rdzv-timeout``. It says so on its console every few seconds ("waiting for
workers: 2 of 4 present, failing in 580 s"), and, so that the people watching the
other hosts' consoles learn it too, it publishes a ``WaitingNotice`` at
``control/waiting`` (keys.py), which every agent follows already. Written once the
wait has lasted an interval (a rendezvous that completes at once writes nothing),
then when the count changes, at most once an interval (arrivals cost every agent
one event per interval, never one per arrival: O(N) traffic, not O(N^2)); on the
coordinator's lease (it vanishes with a dead coordinator), fenced by its election
key, deleted when the wait ends. The other agents print the same line from it on
their own clock.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

from .errors import parsing

log = logging.getLogger(__name__)

# While fewer than min_np workers are present, say so this often (seconds).
WAITING_LINE_INTERVAL_S = 5.0


@dataclass(frozen=True)
class WaitingNotice:
    present: int
    min_np: int
    fails_in: float  # seconds left before the job fails, when written

    def to_json(self) -> bytes:
        return json.dumps({"present": self.present, "min_np": self.min_np, "fails_in": round(self.fails_in, 1)}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "WaitingNotice":
        with parsing("waiting notice"):
            obj = json.loads(data)
            return cls(int(obj["present"]), int(obj["min_np"]), float(obj["fails_in"]))


def notice_due(present: Optional[int], published: Optional[int], published_at: float,
               below_min_since: Optional[float], now: float, interval: float = WAITING_LINE_INTERVAL_S) -> bool:
    """Whether the coordinator writes the notice now (``present``: the count below min_np,
    None once the wait is over; ``published``: the count of the notice in etcd, None for
    none, -1 for not known). The rules of the module's docstring: never a write that
    changes nothing; the first only once the wait has lasted ``interval``, a changed count
    at most once an ``interval``; the end of the wait at once."""
    if present == published:
        return False
    if present is None:
        return True  # the wait ended: the notice goes
    return below_min_since is not None and now - below_min_since >= interval and now - published_at >= interval


class WaitingLine:
    """The line, at once when the count changes and every ``interval`` seconds."""

    def __init__(self, min_np: int, interval: float = WAITING_LINE_INTERVAL_S):
        self._min_np = min_np
        self._interval = interval
        self._last: Optional[tuple[float, int]] = None  # (when, count) of the last line

    def text(self, present: int, remaining: float) -> str:
        return f"waiting for workers: {present} of {self._min_np} present, failing in {max(0.0, remaining):.0f} s"

    def report(self, present: int, remaining: float, now: float) -> Optional[str]:
        """Log (and return) the line when it is due."""
        if self._last is not None and self._last[1] == present and now - self._last[0] < self._interval:
            return None
        self._last = (now, present)
        line = self.text(present, remaining)
        log.info("%s", line)
        return line

    def reset(self) -> None:
        self._last = None


class WaitingEcho:
    """An agent that does not lead: the coordinator's line, from its notice.

    ``tick(notice, received_at)`` on every turn: ``notice`` is the newest one followed
    (None when there is none), ``received_at`` when it arrived (``clock`` time).
    """

    def __init__(self, interval: float = WAITING_LINE_INTERVAL_S, clock: Callable[[], float] = time.monotonic):
        self._interval = interval
        self._clock = clock
        self._line: Optional[WaitingLine] = None

    def tick(self, notice: Optional[WaitingNotice], received_at: float) -> Optional[str]:
        if notice is None:
            self._line = None
            return None
        if self._line is None:
            self._line = WaitingLine(notice.min_np, self._interval)
        now = self._clock()
        return self._line.report(notice.present, notice.fails_in - (now - received_at), now)
