"""How the agent hears what its workers did: it reads the events file they append to.

Workers and the agent append one JSON line per event to the same ``events.jsonl``
(the log directory's, or one in the agent's scratch directory when there is no log
directory). The agent reads the new complete lines on each turn of its loop, so
whatever must react to a worker's event (metrics, straggler eviction) needs no other
channel, and nothing per step goes to etcd.

The tail is also where the file rotates (``contract/log_files.py``): once it has read
to the end of a file over ``max_bytes`` it renames it ``events.jsonl.1``, reads what
was still appended to the renamed file, and goes on in the new one.
"""

from __future__ import annotations

import json
import os
from typing import Any, BinaryIO, Optional

from ..contract.log_files import rotate_shared


class EventTail:
    """The events appended to ``path`` since the last ``read_new`` (complete lines only)."""

    def __init__(self, path: str, *, from_start: bool = False, max_bytes: int = 0):
        self.path = path
        self._max = max_bytes
        self._file: Optional[BinaryIO] = None
        self._rotated: Optional[BinaryIO] = None  # the file renamed at the last turn, read once more
        self._partial = b""
        if not from_start and self._open():
            # A log directory reused from an earlier run: its events are not ours.
            self._file.seek(0, os.SEEK_END)

    def _open(self) -> bool:
        try:
            self._file = open(self.path, "rb")
        except FileNotFoundError:
            self._file = None
        return self._file is not None

    def read_new(self, limit: int = 1 << 20) -> list[dict[str, Any]]:
        events = []
        if self._rotated is not None:
            # Lines of writers that opened the path just before the rename (each holds
            # it for one write): read one turn later, then the renamed file is done.
            events += self._parse(self._rotated.read(), whole=True)
            self._rotated.close()
            self._rotated = None
        if self._file is None and not self._open():
            return events
        data = self._file.read(limit)
        events += self._parse(data)
        if len(data) < limit:  # at the end of this file
            if self._max and os.fstat(self._file.fileno()).st_size > self._max:
                rotate_shared(self.path, self._max)
            if self._replaced():
                events += self._parse(self._file.read(), whole=True)
                self._rotated, self._file = self._file, None
                if self._open():
                    events += self._parse(self._file.read(limit))
        return events

    def _replaced(self) -> bool:
        try:
            return os.stat(self.path).st_ino != os.fstat(self._file.fileno()).st_ino
        except FileNotFoundError:
            return True

    def _parse(self, data: bytes, whole: bool = False) -> list[dict[str, Any]]:
        """``whole``: the rest of a rotated file, whose unfinished line never ends."""
        lines = (self._partial + data).split(b"\n")
        self._partial = b"" if whole else lines.pop()  # an unfinished line (or b"") waits for its end
        events = []
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a torn line from a killed writer: skip it, keep reading
            if isinstance(event, dict):
                events.append(event)
        return events

    def close(self) -> None:
        for f in (self._file, self._rotated):
            if f is not None:
                f.close()
        self._file = self._rotated = None
