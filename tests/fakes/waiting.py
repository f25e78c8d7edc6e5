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


def holds(predicate: Callable[[], object], duration: float, interval: float = 0.05) -> bool:
    """Check ``predicate`` again and again for ``duration`` seconds: True if it held every
    time, False at the first time it did not. For properties that are about time passing
    ("the key is still there after 2.5 TTLs"), checked throughout rather than slept over."""
    deadline = time.monotonic() + duration
    while True:
        if not predicate():
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(interval)


def readline_within(stream, timeout: float) -> str:
    """One line from a child's pipe, or an AssertionError after ``timeout`` seconds
    (a bare readline() would block until the test's own timeout kills everything)."""
    import select

    ready, _, _ = select.select([stream], [], [], timeout)
    if not ready:
        raise AssertionError(f"no line from the child within {timeout:g}s")
    line = stream.readline()
    if not line:
        raise AssertionError("the child closed its output before writing a line")
    return line
