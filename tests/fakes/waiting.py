"""Bounded polling for tests: a condition with a deadline, never a bare sleep."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def poll(predicate: Callable[[], T], timeout: float, interval: float = 0.02) -> T:
    """Call ``predicate`` until it returns something truthy or ``timeout`` passes;
    return its last value (falsy on timeout), so callers can ``assert poll(...)``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)
