"""A worker's output on the console and in its log: lines prefixed, progress bars live, lines bounded.

The agent reads each worker's stdout+stderr as it comes (``os.read``, not line by
line) and hands it to that worker's ``OutputPump``:

* a line (ended by ``\\n``) goes to the log file and, prefixed ``[rankN]: ``, to the
  console, unless it is a log-file-only line (``contract/console.py``). A line that
  torch prefixed itself (its excepthook writes a traceback as ``[rankN]: ...`` once a
  process group exists) gets one prefix, not two;
* a progress bar (tqdm, Lightning's, Hugging Face's) redraws its line after a
  ``\\r``: each redraw reaches the console as it comes, as ``\\r[rankN]: <bar>``
  on one console line, and the log file gets it with its ``\\r``;
* ``--console-ranks`` picks whose output the console shows (``ConsoleRanks``). By
  default every rank's lines, but only rank 0's bar redraws: four workers' bars
  redrawing one console line would interleave. The bar's final line (ended by
  ``\\n``) is a line, shown for every rank. Log files always get everything;
* a line is never buffered without bound: after ``MAX_LINE`` bytes (64 KiB) without
  a ``\\n`` or ``\\r`` the pump ends the line there, marked with ``CUT_MARK``, and the
  rest goes on as a new line (nothing is dropped);
* the log file rotates at ``--log-max-bytes`` (``contract/log_files.py``).

Workers share the agent's console: a line written while another worker's bar is
open on it first ends that line, so the bar redraws on the next one.
"""

from __future__ import annotations

import re
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Optional

from ..contract.console import LOG_FILE_ONLY, OutputRouter, route
from ..contract.log_files import DEFAULT_MAX_BYTES, RotatingFile

MAX_LINE = 64 * 1024
CUT_MARK = b" [elastic-run: line cut at 64 KiB]"
READ_SIZE = 64 * 1024

# Line ends, redraws, and the worker's log-file-only mark: a log record the runtime writes
# while a bar's line is open starts after the bar, not on a line of its own.
_PIECES = re.compile(rb"(\r\n|\r|\n|%s)" % LOG_FILE_ONLY.encode())
# torch's own prefix of a traceback line (distributed_c10d's excepthook): ours replaces it.
_TORCH_PREFIX = re.compile(r"^\[rank\d+\]: ")


@dataclass(frozen=True)
class ConsoleRanks:
    """Whose output reaches the agent's console (None: every rank's)."""

    lines: Optional[frozenset] = None
    bars: Optional[frozenset] = frozenset({0})

    def shows(self, rank: Optional[int], *, bar: bool) -> bool:
        chosen = self.bars if bar else self.lines
        return chosen is None or rank in chosen


def console_ranks(text: str) -> ConsoleRanks:
    """``--console-ranks``: ``all``, or ranks such as ``0`` or ``0,2-3`` (their lines and bars)."""
    text = str(text).strip().lower()
    if text == "all":
        return ConsoleRanks(None, None)
    ranks: set[int] = set()
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise ValueError
        ranks.update(range(first, last + 1))
    return ConsoleRanks(frozenset(ranks), frozenset(ranks))


console_ranks.__name__ = "rank list (0, 0,2-3) or all"


@dataclass(frozen=True)
class WorkerOutput:
    """Where one worker's output goes besides the console."""

    log_path: Optional[str] = None
    max_log_bytes: int = DEFAULT_MAX_BYTES
    console_ranks: ConsoleRanks = ConsoleRanks()


def worker_output(cfg, worker_id: str) -> WorkerOutput:
    """From the agent's config (``AgentConfig``): the worker's log file, its bound, the console's ranks."""
    path = f"{cfg.log_dir}/worker-{worker_id}.log" if cfg.log_dir else None
    return WorkerOutput(path, cfg.log_max_bytes, cfg.console_ranks)


class SharedConsole:
    """The agent's console, shared by its workers' pumps: which one has a bar line open."""

    _by_stream: dict = {}
    _registry_lock = threading.Lock()

    def __init__(self, out):
        self.out = out
        self.lock = threading.Lock()
        self.open_by: Optional[object] = None

    @classmethod
    def of(cls, out) -> "SharedConsole":
        with cls._registry_lock:
            console = cls._by_stream.get(id(out))
            if console is None or console.out is not out:
                console = cls._by_stream[id(out)] = SharedConsole(out)
            return console

    def break_line(self) -> None:
        """Something else is about to write to the terminal (the agent's log on stderr)."""
        with self.lock:
            if self.open_by is not None:
                self.out.write("\n")
                self.out.flush()
                getattr(self.open_by, "line_closed", lambda: None)()
                self.open_by = None

    def write(self, owner: object, text: str, *, leaves_open: bool) -> None:
        with self.lock:
            if self.open_by is not None and self.open_by is not owner:
                self.out.write("\n")  # end the other worker's bar line; it redraws below
                getattr(self.open_by, "line_closed", lambda: None)()
            self.out.write(text)
            self.out.flush()
            self.open_by = owner if leaves_open else None


def end_open_bar(_record=None) -> bool:
    """A filter for the agent's console log handler: its line first ends a worker's open
    bar line on stdout (same terminal), rather than being appended to the bar."""
    SharedConsole.of(sys.stdout).break_line()
    return True


def rank_of_label(label: str) -> Optional[int]:
    """The agent labels a worker ``rankN`` while it holds a rank (``Agent._label``)."""
    return int(label[4:]) if label.startswith("rank") and label[4:].isdigit() else None


class OutputPump:
    """One worker's output stream, fed in chunks as read; see the module's doc."""

    def __init__(self, label: Callable[[], str], console: SharedConsole, log: Optional[RotatingFile] = None,
                 ranks: ConsoleRanks = ConsoleRanks(), max_line: int = MAX_LINE):
        self._label = label
        self._console = console
        self._log = log
        self._ranks = ranks
        self._max = max_line
        self._router = OutputRouter()
        self._pending = b""  # since the last line end or carriage return
        self._line_start = True  # _pending starts a line (no \r in it so far)
        self._to_console = True  # the routing of the current line (decided by its start)
        self._shown: Optional[str] = None  # the bar text on the console's open line, if any
        self._live = False  # _pending (a redraw not ended yet) was shown already

    def feed(self, data: bytes) -> None:
        for i, piece in enumerate(_PIECES.split(data)):
            if i % 2 == 0:
                self._pending += piece
                self._live = self._live and not piece
                while len(self._pending) > self._max:
                    head, self._pending = self._pending[:self._max], self._pending[self._max:]
                    self._end_line(head + CUT_MARK, b"\n")
            elif piece == b"\r":
                self._end_frame()
            elif piece == LOG_FILE_ONLY.encode():
                if self._pending or not self._line_start:
                    self._end_frame(b"")  # the bar so far; the record is a line of its own
                self._pending, self._line_start = piece, True
            else:
                self._end_line(self._pending, piece)
                self._pending = b""
        if self._pending and not self._line_start and not self._live:
            self._show(self._pending)  # a bar redrawn: on the console now, in the log at its end
            self._live = True

    def close(self) -> None:
        """The stream ended: an unfinished last line is still a line."""
        if self._pending:
            self._end_line(self._pending, b"\n")
            self._pending = b""
        elif self._shown is not None:
            self._console.write(self, "\n", leaves_open=False)
            self._shown = None

    def line_closed(self) -> None:
        """Another worker ended our open bar line on the console."""
        self._shown = None

    # -- the pieces -------------------------------------------------------------------
    def _route(self, raw: bytes) -> bytes:
        if self._line_start:
            raw, self._to_console = self._router.route(raw)
            return raw
        return route(raw)[0]

    def _end_frame(self, end: bytes = b"\r") -> None:
        raw = self._route(self._pending)
        self._write_log(raw + end)
        if raw and not self._live:
            self._show(raw)
        self._pending, self._line_start, self._live = b"", False, False

    def _end_line(self, raw: bytes, end: bytes) -> None:
        raw = self._route(raw)
        self._write_log(raw + end)
        label = self._label()
        if self._to_console and self._ranks.shows(rank_of_label(label), bar=False):
            text = _TORCH_PREFIX.sub("", raw.decode(errors="replace"), count=1)
            if self._shown is not None:
                text = f"\r[{label}]: {text}{' ' * max(0, len(self._shown) - len(text))}\n"
            else:
                text = f"[{label}]: {text}\n"
            self._console.write(self, text, leaves_open=False)
            self._shown = None
        elif self._to_console and self._shown is not None:
            self._console.write(self, "\n", leaves_open=False)
            self._shown = None
        # A log-file-only line leaves the console alone: a bar's line there stays open.
        self._line_start, self._to_console, self._live = True, True, False

    def _show(self, raw: bytes) -> None:
        label = self._label()
        if not self._to_console or not self._ranks.shows(rank_of_label(label), bar=True):
            return
        text = raw.decode(errors="replace")
        if text == self._shown:
            return
        pad = " " * max(0, len(self._shown or "") - len(text))
        self._shown = text
        self._console.write(self, f"\r[{label}]: {text}{pad}", leaves_open=True)

    def _write_log(self, data: bytes) -> None:
        if self._log is not None:
            try:
                self._log.write(data)
            except (OSError, ValueError):  # a full disk, or closed at the worker's exit: the console still gets it
                pass
