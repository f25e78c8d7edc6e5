"""Warm worker starts, the agent's end: a template process that has imported torch forks
each worker, so a replacement does not import torch again (``--cold-starts`` turns it off).

The template (``python -m elastic.worker.template``, in the worker room) starts at this
agent's first worker start, with the environment that every worker of the agent shares;
it forks a worker for each request and reports each worker's exit status, which
``WarmProcess`` hands to ``workers.py`` as ``subprocess.Popen`` would. A worker starts
fresh instead (``start`` returns None) when warm starts are off, when the template could
not warm up (no torch, a thread it must not fork), has died, or did not answer in time,
and when the worker's environment differs from the template's in anything but the
variables that name the worker (``worker_env.PER_WORKER``): a setting read when torch is
imported (``OMP_NUM_THREADS``, ``LD_PRELOAD``, ``PYTHON*``...) must be seen at import.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Mapping, Optional, Sequence

from .worker_env import is_per_worker

log = logging.getLogger(__name__)

MAX_MESSAGE = 4 << 20  # as the template's (a request carries a whole environment)
# The first start waits for the template's `import torch` (seconds on a loaded host, less
# than the worker would spend on it); past this it starts fresh.
READY_WAIT_S = 60.0
ANSWER_WAIT_S = 10.0  # a fork and a reply: milliseconds


class WarmProcess:
    """A worker forked by the template: the part of ``subprocess.Popen`` that
    ``workers.py`` uses (pid, poll, wait, returncode; negative when signalled)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: Optional[int] = None
        self._exited = threading.Event()

    def _set_exit(self, status: int) -> None:
        self.returncode = status
        self._exited.set()

    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
        return self.returncode


def why_not_warm(command: Sequence[str], nproc_per_node: int, max_restarts: int,
                 read: Callable[[str], str] = lambda path: open(path, errors="replace").read()) -> Optional[str]:
    """Why this agent's workers gain nothing from a template, if they do not.

    The template costs one ``import torch`` (and torch._dynamo: 2.8 s of CPU here) and saves
    as much at each worker start that would have imported torch. An agent that starts one
    worker, and replaces none, saves nothing; a script that never imports torch loses it.
    Whether a script imports torch is read from its text (or the elastic API's, which
    imports it); a module run with -m is taken to. A script missed here starts fresh: the
    decision costs speed, never correctness."""
    if nproc_per_node < 2 and max_restarts < 1:
        return "one worker and no --max-restarts: a template would not pay for its own import of torch"
    if command and command[0] != "-m":
        try:
            text = read(command[0])
        except OSError:
            return None  # the worker's start will say why it cannot read it
        if "torch" not in text and "elastic" not in text:
            return "the script imports neither torch nor elastic"
    return None


class WorkerTemplate:
    """One agent's template process; ``start`` forks a worker from it, or says to start
    one fresh. Start it from the thread that starts the workers: like them, it dies with
    that thread (parent-death signal)."""

    def __init__(self, enabled: bool = True, *, python: str = sys.executable, preload: Optional[str] = None,
                 ready_wait: float = READY_WAIT_S, popen: Callable = subprocess.Popen):
        self.enabled = enabled
        self._why_off: Optional[str] = None if enabled else "--cold-starts"
        self._preload = ["--preload", preload] if preload is not None else []  # tests: a template without torch
        self._python = python
        self._ready_wait = ready_wait
        self._popen = popen
        self._proc: Optional[subprocess.Popen] = None
        self._sock: Optional[socket.socket] = None
        self._env: Optional[dict] = None  # the environment the template started with
        self._ready = threading.Event()
        self._usable = False
        self._why_not: Optional[str] = None
        self._lock = threading.Lock()
        self._answers: dict[int, dict] = {}
        self._answered = threading.Condition(self._lock)
        self._next_id = 0
        self._live: dict[int, WarmProcess] = {}
        self._reader: Optional[threading.Thread] = None
        self._told: set[str] = set()  # why-cold reasons already logged

    @classmethod
    def of(cls, config) -> "WorkerTemplate":
        """The template of an agent of ``config`` (an AgentConfig): off with --cold-starts, or
        when it would not pay (why_not_warm)."""
        template = cls(config.warm_starts)
        if template.enabled:
            template._why_off = why_not_warm(config.command, config.nproc_per_node, config.max_restarts)
            template.enabled = template._why_off is None
        return template

    # -- the template's life ------------------------------------------------------------
    def _launch(self, env: Mapping[str, str], cwd: str) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for end in (ours, theirs):
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, MAX_MESSAGE)
            end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, MAX_MESSAGE)
        self._env = dict(env)
        try:
            self._proc = self._popen(
                [self._python, "-u", "-m", "elastic.worker.template",
                 "--agent-pid", str(os.getpid()), "--fd", str(theirs.fileno()), *self._preload],
                env=self._env, cwd=cwd, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C reaches the agent, which decides
            )
        except OSError as exc:
            self._why_not = f"cannot start the template: {exc}"
            self._ready.set()
            return
        finally:
            theirs.close()
        self._sock = ours
        self._reader = threading.Thread(target=self._read, name="worker-template", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        sock = self._sock
        while True:
            try:
                data = sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            message = json.loads(data)
            if "ready" in message:
                self._usable = bool(message["ready"])
                self._why_not = message.get("why")
                self._ready.set()
            elif "exited" in message:
                with self._lock:
                    proc = self._live.pop(message["exited"], None)
                if proc is not None:
                    proc._set_exit(message["status"])
            elif "id" in message:
                with self._lock:
                    if "pid" in message:  # before its exit can be read: the template replies first
                        message["proc"] = self._live[message["pid"]] = WarmProcess(message["pid"])
                    self._answers[message["id"]] = message
                    self._answered.notify_all()
        self._on_template_gone()

    def _on_template_gone(self) -> None:
        """Its workers die with it (parent-death signal); each one's exit is reported
        once its pid is gone, as a SIGKILL (their parent, not we, saw their status)."""
        with self._lock:
            self._usable = False
            self._why_not = self._why_not or "the template exited"
            orphans, self._live = list(self._live.values()), {}
            self._answered.notify_all()
        self._ready.set()
        deadline = time.monotonic() + 10.0
        for proc in orphans:
            while _exists(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.01)
            proc._set_exit(-signal.SIGKILL)

    def close(self) -> None:
        """End the template (its workers are ended already, or end with it). SIGKILL: it
        holds nothing to save, and an interpreter with torch takes a while to exit."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
        if self._reader is not None:
            self._reader.join(5)
        if self._sock is not None:
            self._sock.close()

    # -- starting a worker ----------------------------------------------------------------
    def start(self, command: Sequence[str], env: Mapping[str, str], cwd: str, output_fd: int) -> Optional[WarmProcess]:
        """Fork the worker ``command`` (script + args, or -m module + args) with ``env``,
        ``cwd`` and ``output_fd`` as its stdout and stderr; None: start it fresh."""
        if not self.enabled:
            return None  # chosen (--cold-starts, why_not_warm): nothing to tell
        shared = {k: v for k, v in env.items() if not is_per_worker(k)}
        if self._env is None:
            self._launch(shared, cwd)
        if not self._ready.wait(self._ready_wait):
            return self._cold("the template is not ready yet")
        if not self._usable:
            return self._cold(self._why_not or "the template cannot start workers")
        if shared != self._env:
            changed = sorted(k for k in set(shared) | set(self._env) if shared.get(k) != self._env.get(k))
            return self._cold(f"the worker's environment differs from the template's in {', '.join(changed[:5])}")
        with self._lock:
            self._next_id += 1
            request_id = self._next_id
        try:
            message = json.dumps({"id": request_id, "argv": list(command), "env": dict(env), "cwd": cwd}).encode()
            socket.send_fds(self._sock, [message], [output_fd])
        except (OSError, ValueError) as exc:  # a closed template; an environment that is not text (surrogates)
            return self._cold(f"cannot hand the worker to the template: {exc}")
        with self._lock:
            self._answered.wait_for(lambda: request_id in self._answers or not self._usable, ANSWER_WAIT_S)
            answer = self._answers.pop(request_id, None)
            if answer is not None and "proc" in answer:
                return answer["proc"]
        if answer is None:
            return self._cold("the template did not answer")
        return self._cold(answer.get("cold", "the template refused"))

    def _cold(self, why: str) -> None:
        if why not in self._told:
            self._told.add(why)
            log.info("starting workers fresh, not from the template: %s", why)
        return None


def _exists(pid: int) -> bool:
    """Alive, or dead but not reaped yet by whoever adopted it (a zombie is gone for us)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
