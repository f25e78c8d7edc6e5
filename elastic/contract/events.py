"""Events: one JSON line per thing that happened, for people and benchmarks.

Agents and workers append to the same ``events.jsonl`` (one ``write`` of one
line with O_APPEND, so lines from several processes never interleave), and the
same event is logged as one human line with the rank and round.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, Optional

from .console import FILE_ONLY

log = logging.getLogger("elastic.contract.events")

# Periodic records (step_log.py): in the events file for tools, no human line a second.
_QUIET = frozenset({"steps"})


class EventLog:
    def __init__(self, path: Optional[str], *, host: str, rank: Optional[int] = None):
        self._path = path
        self.path = path
        self._host = host
        self.rank = rank
        self.round: Optional[int] = None
        self._lock = threading.Lock()
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def emit(self, event: str, *, console: bool = True, **fields: Any) -> None:
        """Record the event; ``console=False``: its human line goes to the log file only."""
        record = {
            "time": time.time(),
            "event": event,
            "host": self._host,
            "round": fields.pop("round", self.round),
            "rank": fields.pop("rank", self.rank),
            **fields,
        }
        fields_shown = {k: v for k, v in record.items() if k not in ("time", "event", "host", "round", "rank")}
        details = _HUMAN.get(event, _fields)(fields_shown)
        # Before the first round there is no round to name (not "round None").
        prefix = f"round {record['round']}: " if record["round"] is not None else ""
        if event not in _QUIET:
            log.info("%s%s %s", prefix, event, details, extra=None if console else FILE_ONLY)
        if not self._path:
            return
        line = (json.dumps(record, default=str) + "\n").encode()
        with self._lock:
            fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)


def _fields(fields: dict) -> str:
    return " ".join(f"{k}={_short(v)}" for k, v in fields.items())


def _reform_done(fields: dict) -> str:
    """A re-formation in words first: ``failed`` means it followed a failure, and it
    succeeded (the event is emitted once the ring trains again), so it reads as a
    recovery; the failure's text is its cause; the phases follow as fields."""
    fields = dict(fields)
    failed, reason = fields.pop("failed", False), fields.pop("reason", None)
    world, total, commit = fields.pop("world_size", None), fields.pop("total_s", None), fields.pop("commit", None)
    took = f"{total:.3f} s" if isinstance(total, (int, float)) else "?"
    if failed:
        head = f"recovered: training again at world size {world} {took} after the failure, from commit {commit}"
        cause = f"; cause: {_short(reason)}" if reason else ""
    else:
        head = f"re-formed: world size {world} at commit {commit}, nothing rolled back, in {took}"
        cause = f" ({_short(reason)})" if reason else ""
    return f"{head}{cause}" + (f"; {_fields(fields)}" if fields else "")


# Events whose human line says what happened in words before its fields.
_HUMAN = {"reform_done": _reform_done}


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    text = str(value)
    return text if len(text) <= 120 else text[:117] + "..."

