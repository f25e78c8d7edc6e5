"""Which of a worker's lines reach the console, and which stay in its log file.

A failure is one line per worker on the console (the ``reform_done`` line: what
broke, the new world size, how long each phase took); what led to it (gloo's
whole message, the abort of the old ring, the ``failure_detected`` event) goes
to the worker's log file only (``--log-dir``). The worker marks such lines with
``LOG_FILE_ONLY`` at the start of each of their lines; the agent's output pump
(``agent/workers.py``) writes them to the log file without the mark and keeps
them off the console. A worker run without an agent prints every line as is.
Warnings and errors say so at the start of their message, the agent's and the
workers' alike (``ConsoleFormatter``). torch's C++ logging writes to the worker's
stderr itself, unmarked: when a ring breaks, c10d logs a warning with a stack of
frames (a store write on an aborted ring's socket); ``OutputRouter`` recognises such
records and keeps them, with their continuation lines, in the log file only.
"""

from __future__ import annotations

import copy
import logging
import re

LOG_FILE_ONLY = "\x1f"  # ASCII unit separator: never starts a line people write (nor ends one)
# ``extra=`` for a log call whose line belongs in the log file only.
FILE_ONLY = {"log_file_only": True}


class ConsoleFormatter(logging.Formatter):
    """``fmt``, with the level before the message of a warning or an error
    (``elastic-run: WARNING: ...``): on a console of one-line messages without levels,
    a warning must still read as one (and a successful job must show none)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        if record.levelno >= logging.WARNING:
            record = copy.copy(record)  # other handlers format the record as it is
            record.message = f"{record.levelname}: {record.message}"
        return super().formatMessage(record)


class WorkerFormatter(ConsoleFormatter):
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


# A record of torch's C++ logging (c10): "[W1124 20:26:30.569049306 TCPStore.cpp:106] ...",
# with "[rank1]:" before it once a process group exists (I, W, E: info, warning, error).
_CPP_RECORD = re.compile(rb"^(\[rank\d+\]:)?\[[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ [^\]]*\] ")
# The lines that follow such a record: the exception's origin and its stack, then an empty line.
_CPP_CONTINUED = re.compile(rb"^(Exception raised from |frame #\d+: |<omitting python frames>)")


class OutputRouter:
    """``route`` for a worker's output stream, one line after the other: also keeps
    torch's C++ log records (and the stack lines after one) off the console."""

    def __init__(self):
        self._in_cpp_record = False

    def route(self, raw: bytes) -> tuple[bytes, bool]:
        line, to_console = route(raw)
        if not to_console:
            return line, False
        if _CPP_RECORD.match(line):
            self._in_cpp_record = True
            return line, False
        if self._in_cpp_record:
            if _CPP_CONTINUED.match(line):
                return line, False
            self._in_cpp_record = False
            if not line.strip():  # the empty line that ends the record's stack
                return line, False
        return line, True
