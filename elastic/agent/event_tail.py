"""How the agent hears what its workers did: it reads the events file they append to.

Workers and the agent append one JSON line per event to the same ``events.jsonl``
(the log directory's, or one in the agent's scratch directory when there is no log
directory). The agent reads the new complete lines on each turn of its loop, so
whatever must react to a worker's event (metrics, straggler eviction) needs no other
channel, and nothing per step goes to etcd.
"""

from __future__ import annotations

import json
import os
from typing import Any


class EventTail:
    """The events appended to ``path`` since the last ``read_new`` (complete lines only)."""

    def __init__(self, path: str, *, from_start: bool = False):
        self.path = path
        self._offset = 0
        self._partial = b""
        if not from_start and os.path.exists(path):
            # A log directory reused from an earlier run: its events are not ours.
            self._offset = os.path.getsize(path)

    def read_new(self, limit: int = 1 << 20) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read(limit)
        except FileNotFoundError:
            return []
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()  # an unfinished line (or b"") waits for its end
        events = []
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a torn line from a killed writer: skip it, keep reading
            if isinstance(event, dict):
                events.append(event)
        return events
