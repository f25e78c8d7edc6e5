"""Local worker processes: start, forward their output (output_pump.py), see them exit, stop them.

A worker is forked from the agent's template when it can be (warm_start.py: torch is
imported already), else started fresh; the rest is the same for both."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from ..contract.faults import ExitRecord, read_record
from ..contract.log_files import RotatingFile
from .warm_start import WarmProcess, WorkerTemplate  # noqa: F401 (WorkerTemplate: the agent's)
from .output_pump import READ_SIZE, OutputPump, SharedConsole, WorkerOutput, worker_output  # noqa: F401 (the agent's)


@dataclass(frozen=True)
class Exited:
    """A worker process ended; posted to the agent's inbox by its waiter thread."""

    worker_id: str
    pid: int  # a restarted worker keeps its id: the pid tells the two apart
    exit_code: Optional[int]  # None when killed by a signal
    signal: Optional[int]
    record: Optional[ExitRecord]  # what the worker said of its end (contract/faults.py), if anything


class WorkerProcess:
    def __init__(
        self,
        worker_id: str,
        argv: Sequence[str],
        env: dict,
        *,
        started_round: int,
        label: Callable[[], str],
        inbox: "queue.Queue",
        output: WorkerOutput,
        error_file: str,
        marker_file: str,
        out=None,
        template: Optional[WorkerTemplate] = None,
    ):
        self.worker_id = worker_id
        self.started_round = started_round
        self.error_file = error_file
        self.marker_file = marker_file
        self.stopping = False  # we asked it to stop: its exit is not a failure
        self.lost_reason: Optional[str] = None  # why we killed it as lost (a hang), if we did
        self._label = label
        self._out = out or sys.stdout
        self._output = output
        self._log = RotatingFile(output.log_path, output.max_log_bytes) if output.log_path else None
        for path in (error_file, marker_file):
            if os.path.exists(path):
                os.unlink(path)
        self.proc, self._output_fd = self._start_warm(template, argv, env) or self._start_fresh(argv, env)
        self.warm = isinstance(self.proc, WarmProcess)
        self.pid = self.proc.pid
        self.started_at = time.monotonic()
        self._pump = threading.Thread(target=self._forward_output, name=f"out-{worker_id}", daemon=True)
        self._pump.start()
        self._waiter = threading.Thread(
            target=self._wait, args=(inbox,), name=f"wait-{worker_id}", daemon=True
        )
        self._waiter.start()

    @staticmethod
    def _start_fresh(argv: Sequence[str], env: dict):
        # Own session: a Ctrl-C at the terminal reaches the agent, which decides.
        proc = subprocess.Popen(
            list(argv),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return proc, proc.stdout.fileno()

    @staticmethod
    def _start_warm(template: Optional[WorkerTemplate], argv: Sequence[str], env: dict):
        """Forked from the template when ``argv`` is this interpreter's bootstrap (the
        template is this interpreter too, so anything else starts fresh)."""
        command = list(argv)
        if template is None or command[:4] != [sys.executable, "-u", "-m", "elastic.worker.bootstrap"]:
            return None
        read_end, write_end = os.pipe()
        try:
            proc = template.start(command[4:], env, os.getcwd(), write_end)
        finally:
            os.close(write_end)  # the worker holds its own copy: EOF when it and its children end
        if proc is None:
            os.close(read_end)
            return None
        return proc, read_end

    @property
    def elastic(self) -> bool:
        """The worker called elastic.init(): it follows rounds itself."""
        return os.path.exists(self.marker_file)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def _forward_output(self) -> None:
        # Read as it comes, not by lines: a progress bar's redraws end in \r, not \n.
        pump = OutputPump(self._label, SharedConsole.of(self._out), self._log, self._output.console_ranks)
        fd = self._output_fd
        while True:
            data = os.read(fd, READ_SIZE)
            if not data:
                break
            pump.feed(data)
        pump.close()
        if self.warm:
            os.close(fd)
        else:
            self.proc.stdout.close()

    def _wait(self, inbox: "queue.Queue") -> None:
        code = self.proc.wait()
        self._pump.join(timeout=5)  # the last lines of output come before the exit event
        record = read_record(self.error_file)
        if self._log is not None:
            self._log.close()
        inbox.put(Exited(self.worker_id, self.pid, code if code >= 0 else None, -code if code < 0 else None, record))

    def signal(self, signum: int) -> None:
        if self.alive:
            try:
                os.killpg(self.pid, signum)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        """SIGTERM, then SIGKILL; the exit still arrives through the inbox."""
        self.stopping = True
        self.signal(signal.SIGTERM)

    def kill(self) -> None:
        self.stopping = True
        self.signal(signal.SIGKILL)

    def join(self, timeout: float) -> bool:
        try:
            self.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
