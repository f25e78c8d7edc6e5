"""Warm worker starts: one process per agent that has imported torch forks each worker.

A worker started fresh pays for its interpreter and ``import torch`` (1.5-4 s of CPU on a
2-core host) before its first step; a replacement forked from this template starts at the
user's script. The agent runs ``python -u -m elastic.worker.template --agent-pid PID --fd FD``
with the environment its workers share (``agent/worker_env.py``), and talks to it over the
inherited socket (``agent/warm_start.py`` is the other end). Every message is one JSON
datagram:

* template -> agent, once: ``{"ready": true, "pid": ...}`` (or ``false`` and ``why``);
* agent -> template: ``{"id", "argv", "env", "cwd"}`` with the worker's output pipe attached
  (SCM_RIGHTS); the answer ``{"id", "pid"}``, or ``{"id", "cold": why}`` when this worker
  must start fresh instead;
* template -> agent, for each worker it forked: ``{"exited": pid, "status": code}``, the
  status as ``subprocess`` gives it (a negative signal number when killed).

The template reaps its workers and reports their statuses (rather than double-forking
them onto the agent as a child subreaper): the agent then adopts no stray grandchildren
that it would have to reap, and reaping them with ``waitpid(-1)`` would steal the
statuses that ``subprocess`` waits for (the etcd server it may serve, ``kubectl``...).

The forked worker starts as a fresh interpreter would: its own session, stdin on
/dev/null, stdout and stderr on the agent's pipe, no other file descriptor, the
template's starting signal handlers and an empty signal mask, its own environment
(``os.environ``, which is the C environment too), cwd, ``sys.argv`` and ``sys.path[0]``,
and fresh random seeds (Python's ``random`` reseeds itself at fork; torch's CPU generator
and numpy's global one are reseeded here: a fresh process draws them from the OS). It
dies with the template (parent-death signal), which dies with the agent. The template
itself never runs user code, never initialises CUDA (it forks nothing once the CUDA
driver is loaded) and runs no thread of its own, so
what one worker changes (``sys.path``, ``sys.modules``, warnings filters, torch's
settings) is never seen by the next. What a fork cannot give: Python's string hash seed
is the template's (set once per interpreter), and the modules the template imported
(torch, torch._dynamo and what they import) are in ``sys.modules`` before the script
starts, with what their import did (sympy's warnings filter for its own deprecations).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import select
import signal
import socket
import sys
from typing import Optional

from .bootstrap import die_with_parent, run_script

# What every worker imports: torch (with torch.distributed and torch.nn), and torch._dynamo,
# which torch imports on first use, at the first optimizer's construction (1.3 s of CPU
# more, with sympy and FSDP's modules). Neither starts a thread or touches CUDA.
PRELOAD = "torch,torch._dynamo"
# A request carries a worker's whole environment: a few KB, more on some clusters.
MAX_MESSAGE = 4 << 20


def _send(sock: socket.socket, message: dict) -> None:
    sock.send(json.dumps(message).encode())


def _reap(sock: socket.socket, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _send(sock, {"exited": pid, "status": os.waitstatus_to_exitcode(status)})


def _threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1


# Threads running once the imports are done. With torch 2.13 that is one besides ours:
# OpenBLAS's pool (numpy's), started when the library loads, which stops itself around a
# fork and starts again in the child (pthread_atfork). Any thread started after that was
# not measured here, and makes the template refuse to fork.
_AFTER_IMPORTS: list[int] = []


def _why_cold() -> Optional[str]:
    """Why a fork now would not give a fresh process's state, if it would not."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised in the template"
    if _cuda_driver_loaded():
        # cuInit ran (a device count asked of the runtime, not NVML): a forked child's CUDA
        # calls would fail with "initialization error".
        return "the CUDA driver is loaded in the template"
    if _AFTER_IMPORTS and _threads() > _AFTER_IMPORTS[0]:
        return f"the template runs {_threads()} threads, {_AFTER_IMPORTS[0]} after its imports"
    return None


def _cuda_driver_loaded() -> bool:
    try:
        with open("/proc/self/maps") as f:
            return "/libcuda.so" in f.read()
    except OSError:
        return False


def _own_start_up_code() -> Optional[str]:
    """A sitecustomize or usercustomize from outside this interpreter's installation (a
    PYTHONPATH entry): code that every interpreter runs as it starts, with its own
    environment. The template ran it with the template's; a fresh worker runs it with its
    own (a worker id, a rank), and may do something else."""
    installed = tuple(os.path.realpath(p) + os.sep for p in {sys.prefix, sys.base_prefix, sys.exec_prefix})
    for name in ("sitecustomize", "usercustomize"):
        path = getattr(sys.modules.get(name), "__file__", None)
        if path and not os.path.realpath(path).startswith(installed):
            return f"{path} runs at each interpreter's start, with its environment"
    return None


def _warm_up(modules: list[str]) -> Optional[str]:
    """Import what every worker imports first; why not, if it cannot."""
    custom = _own_start_up_code()
    if custom is not None:
        return custom
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any failure means fresh starts, which will show it
            return f"cannot import {name}: {exc}"
    _AFTER_IMPORTS.append(_threads())
    return _why_cold()


def serve(sock: socket.socket, initial_handlers: dict) -> Optional[tuple[dict, list[int]]]:
    """Answer the agent until it closes the socket (then return None). In a forked worker
    this returns its request and file descriptors, for ``main`` to run the script."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the wake-up byte is what counts
    children: set[int] = set()
    while True:
        try:
            ready, _, _ = select.select([sock, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in ready:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
        _reap(sock, children)
        if sock not in ready:
            continue
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 4)
        except ConnectionResetError:
            data, fds = b"", []
        if not data:
            return None  # the agent closed us: our workers go with us (parent-death signal)
        request = json.loads(data)
        why = _why_cold()
        if why is not None:
            for fd in fds:
                os.close(fd)
            _send(sock, {"id": request["id"], "cold": why})
            continue
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            for signum, handler in initial_handlers.items():
                if signal.getsignal(signum) is not handler:
                    signal.signal(signum, handler)
            os.close(wake_r)
            os.close(wake_w)
            return request, fds
        children.add(pid)
        for fd in fds:
            os.close(fd)
        _send(sock, {"id": request["id"], "pid": pid})


def _initial_handlers() -> dict:
    handlers = {}
    for signum in signal.valid_signals():
        try:
            handler = signal.getsignal(signum)
        except (OSError, ValueError):
            continue
        if handler is not None:
            handlers[signum] = handler
    return handlers


def become_worker(request: dict, fds: list[int], sock: socket.socket, template_pid: int) -> None:
    """In the forked child: a fresh process's state, then the worker's own."""
    sock.close()
    os.setsid()
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[0], 2)
    os.closerange(3, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 65536)
    die_with_parent(template_pid)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _reseed()


def _reseed() -> None:
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m elastic.worker.template")
    parser.add_argument("--agent-pid", type=int, required=True)
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--preload", default=PRELOAD, help="modules to import before forking (comma-separated)")
    args = parser.parse_args(argv)
    die_with_parent(args.agent_pid)
    handlers = _initial_handlers()
    sock = socket.socket(fileno=args.fd)
    why = _warm_up([m for m in args.preload.split(",") if m])
    _send(sock, {"ready": why is None, "pid": os.getpid(), **({"why": why} if why else {})})
    if why is not None:
        return
    template_pid = os.getpid()
    forked = serve(sock, handlers)
    if forked is None:
        return
    request, fds = forked
    become_worker(request, fds, sock, template_pid)
    del forked, request["env"]
    run_script(request["argv"])


if __name__ == "__main__":
    main()
