"""Which of a worker's lines reach the console, and which stay in its log file.

A failure is one line per worker on the console (the ``reform_done`` line: what
broke, the new world size, how long each phase took); what led to it (gloo's
whole message, the abort of the old ring, the ``failure_detected`` event) goes
to the worker's log file only (``--log-dir``). The worker marks such lines with
``LOG_FILE_ONLY`` at the start of each of their lines; the agent's output pump
(``agent/workers.py``) writes them to the log file without the mark and keeps
them off the console. A worker run without an agent prints every line as is.
"""

from __future__ import annotations

import logging

LOG_FILE_ONLY = "\x1f"  # ASCII unit separator: never starts a line people write (nor ends one)
# ``extra=`` for a log call whose line belongs in the log file only.
FILE_ONLY = {"log_file_only": True}


class WorkerFormatter(logging.Formatter):
    """``<name>: message``; with ``marks``, every line of a FILE_ONLY record is marked."""

    def __init__(self, fmt: str, *, marks: bool):
        super().__init__(fmt)
        self._marks = marks

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if self._marks and getattr(record, "log_file_only", False):
            return "\n".join(LOG_FILE_ONLY + line for line in text.split("\n"))
        return text


def route(raw: bytes) -> tuple[bytes, bool]:
    """(the line for the log file, whether it goes to the console too)."""
    if raw.startswith(LOG_FILE_ONLY.encode()):
        return raw[len(LOG_FILE_ONLY):], False
    return raw, True
