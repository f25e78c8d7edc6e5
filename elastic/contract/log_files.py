"""Log files that stay within a size: rotation of events.jsonl and worker logs, and reading them back.

A log over ``max_bytes`` is renamed ``NAME.1`` (the older ones move to ``.2``, ...,
and the oldest beyond ``KEEP_ROTATED`` is deleted), and a new ``NAME`` starts. So a
job that runs for weeks keeps at most ``(KEEP_ROTATED + 1) * max_bytes`` of each
log (``--log-max-bytes``, default ``DEFAULT_MAX_BYTES``; 0: never rotate).

* A worker's log has one writer (its agent's output pump): ``RotatingFile``.
* ``events.jsonl`` has many (the agent and its workers append whole lines with
  O_APPEND, opening the path for each): only the agent rotates it, from its event
  tail (``agent/event_tail.py``), under an ``flock`` on ``NAME.lock`` so that two
  agents sharing a log directory never both shift the files. A worker that opened
  the path just before the rename writes its line into ``NAME.1``: nothing is lost,
  and readers sort events by time.

Readers (``elastic-run timeline``, the tests) read ``log_paths(NAME)``: the rotated
files, oldest first, then ``NAME``.
"""

from __future__ import annotations

import fcntl
import os
import re
from typing import BinaryIO, Optional

DEFAULT_MAX_BYTES = 100 * 1024 * 1024
KEEP_ROTATED = 5  # NAME.1 .. NAME.5

_SIZE = re.compile(r"^\s*(\d+)\s*([kmg]?)(i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1024, "m": 1024 ** 2, "g": 1024 ** 3}


def byte_size(text: str) -> int:
    """``--log-max-bytes``: ``100M``, ``64KiB``, ``1g``, ``1048576``; 0 turns rotation off."""
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError
    value = int(match.group(1)) * _UNITS[match.group(2).lower()]
    if 0 < value < 4096:  # a bound below one page would rotate on every few events
        raise ValueError
    return value


byte_size.__name__ = "size in bytes (100M, 64KiB, ...; at least 4096, or 0: never rotate)"


def rotated_path(path: str, n: int) -> str:
    return f"{path}.{n}"


def log_paths(path: str) -> list[str]:
    """The files of the log ``path`` that exist, oldest first: ``path.N`` ... ``path.1``, ``path``."""
    directory, name = os.path.split(path)
    numbers = []
    try:
        for entry in os.listdir(directory or "."):
            if entry.startswith(name + ".") and entry[len(name) + 1:].isdigit():
                numbers.append(int(entry[len(name) + 1:]))
    except FileNotFoundError:
        return []
    paths = [rotated_path(path, n) for n in sorted(numbers, reverse=True)]
    return paths + ([path] if os.path.exists(path) else [])


def rotate(path: str, keep: int = KEEP_ROTATED) -> None:
    """``path`` -> ``path.1``, ``path.1`` -> ``path.2``, ...; the oldest beyond ``keep`` goes."""
    for n in range(keep, 0, -1):
        older = rotated_path(path, n)
        if not os.path.exists(older):
            continue
        if n == keep:
            os.unlink(older)
        else:
            os.replace(older, rotated_path(path, n + 1))
    if os.path.exists(path):
        os.replace(path, rotated_path(path, 1))


def rotate_shared(path: str, max_bytes: int, keep: int = KEEP_ROTATED) -> bool:
    """Rotate ``path`` if it is over ``max_bytes``, under a lock that other rotators
    of the same file take too (they find it already rotated). True if this call did."""
    if max_bytes <= 0:
        return False
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if os.path.getsize(path) <= max_bytes:
                return False
        except FileNotFoundError:
            return False
        rotate(path, keep)
        return True


class RotatingFile:
    """An append-only file of one writer that rotates once it is over ``max_bytes``
    (0: never). Unbuffered: what was written is in the file (a worker may be killed)."""

    def __init__(self, path: str, max_bytes: int = DEFAULT_MAX_BYTES, keep: int = KEEP_ROTATED):
        self.path = path
        self._max = max_bytes
        self._keep = keep
        self._file: Optional[BinaryIO] = open(path, "ab", buffering=0)
        self._size = os.fstat(self._file.fileno()).st_size

    def write(self, data: bytes) -> None:
        if self._file is None:
            return
        if self._max and self._size and self._size + len(data) > self._max:
            self._file.close()
            rotate(self.path, self._keep)
            self._file = open(self.path, "ab", buffering=0)
            self._size = 0
        self._file.write(data)
        self._size += len(data)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
