"""Aborting an NCCL ring: every group, off the caller's thread, within a deadline.

``ProcessGroupNCCL::abort()`` is a real abort (pending kernels exit, later
collectives raise), but it blocks: it waits for ``ncclCommAbort``, which can take
as long as the group's timeout when a peer is gone. The plan-driven abort runs
on the etcd watch thread (``RingCell.on_control``, ring_entry.py), which must go on delivering
plans meanwhile (gpu review F4c). So the abort runs on a thread of its own, and a
second thread waits for it with a deadline: past the deadline the process is
broken (a driver call that does not return) and exits with ``WORKER_BROKEN``, so
that its agent replaces it (a broken process, not a user error).

Every group of the process is aborted, not only the default one (DDP and user
code may have made sub-groups), each on a thread of its own and all at once
(pytorch#119797: aborts of several communicators one after the other can deadlock,
the first one's frees waiting for another's still-spinning kernel). torch's own
``_abort_process_group`` wraps them in ``ncclGroupStart/End`` instead, which groups
nothing: each ``ProcessGroupNCCL::abort`` runs ``ncclCommAbort`` on a thread of its
own, and NCCL's group state is per thread (gpu review G9). ``_world`` is left as it is here: the main
thread may be inside a collective, and a half-cleared ``_world`` would make its
next call fail as a user error. The main thread clears it when it leaves the
ring (``leave_aborted``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..contract.exit_codes import WORKER_BROKEN
from . import exit_record
from .failures import broken_process

log = logging.getLogger(__name__)

# How long an NCCL abort may take before the process counts as broken. ncclCommAbort
# of a healthy driver returns in well under a second even with a dead peer (NCCL >= 2.25,
# non-blocking communicators), but an abort may first wait for a collective that holds
# a forming communicator's lock through TORCH_NCCL_NONBLOCKING_TIMEOUT, and leave_aborted
# for a group's destructor that joins the heartbeat monitor (TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC).
# Both grow with --max-np, up to 120 s and 135 s (agent/worker_env.py nccl_waits; its copy
# of this value, WORKER_ABORT_DEADLINE_S, is tested equal): the deadline lies above both,
# so that a healthy abort is never taken for a broken process (gpu review N5, N6).
ABORT_DEADLINE_S = 150.0


def exit_broken(why: str) -> None:
    """End this worker now: its agent sees WORKER_BROKEN and replaces it."""
    log.error("worker process broken: %s; exiting with status %d so that its agent replaces it", why, WORKER_BROKEN)
    exit_record.failed(broken_process(why))
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not keep us alive
            pass
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(WORKER_BROKEN)


def run_with_deadline(work: Callable[[], None], deadline_s: float, on_overrun: Callable[[str], None],
                      name: str) -> threading.Event:
    """Run ``work`` on a thread of its own; call ``on_overrun(why)`` if it has not ended
    within ``deadline_s``. Returns at once an event set when ``work`` has ended."""
    done = threading.Event()

    def run() -> None:
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - an abort that raises has still ended
            log.warning("%s: %s: %s", name, type(exc).__name__, exc)
        finally:
            done.set()

    def watch() -> None:
        if not done.wait(deadline_s):
            on_overrun(f"{name} did not return within {deadline_s:g}s")

    threading.Thread(target=run, name=name, daemon=True).start()
    threading.Thread(target=watch, name=f"{name}-deadline", daemon=True).start()
    return done


def _nccl_class():
    if not dist.is_nccl_available():
        return None
    from torch.distributed import ProcessGroupNCCL

    return ProcessGroupNCCL


def abort_every_group(backend) -> None:
    """Abort every process group of this process (``backend``: the default group's
    NCCL backend); a backend that is not NCCL's (tests) is aborted alone."""
    nccl = _nccl_class()
    if nccl is None or not isinstance(backend, nccl):
        backend.abort()
        return
    from torch.distributed import distributed_c10d

    world = distributed_c10d._world
    groups = sorted(list(world.pg_names.items()), key=lambda item: item[1], reverse=True)
    abort_all_at_once([group.abort for group, _ in groups])


def abort_all_at_once(aborts: Sequence[Callable[[], None]]) -> None:
    """Start every abort on a thread of its own, then wait for all of them (the caller's
    deadline bounds the wait: ``run_with_deadline``). One that raises does not stop the others."""

    def run(abort: Callable[[], None]) -> None:
        try:
            abort()
        except Exception as exc:  # noqa: BLE001 - an abort that raises has still ended
            log.warning("abort of a process group: %s: %s", type(exc).__name__, exc)

    threads = [threading.Thread(target=run, args=(abort,), name=f"elastic-nccl-abort-{i}", daemon=True)
               for i, abort in enumerate(aborts)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def leave_aborted(deadline_s: float = ABORT_DEADLINE_S,
                  on_overrun: Callable[[str], None] = exit_broken) -> bool:
    """Forget every process group after an abort, without the shutdown that waits for
    pending work and for peers (``destroy_process_group`` would). True if no group is
    left; bounded by ``deadline_s`` (past it, ``on_overrun``)."""
    from torch.distributed import distributed_c10d

    if not dist.is_initialized():
        return True
    done = run_with_deadline(distributed_c10d._abort_process_group, deadline_s, on_overrun, "elastic-leave-ring")
    done.wait(deadline_s)
    return not dist.is_initialized()


def nonblocking_env(environ: Optional[dict] = None) -> None:
    """Ask for non-blocking NCCL communicators (unless the user chose): an abort then
    reaches a communicator whose set-up waits for a dead peer."""
    environ = os.environ if environ is None else environ
    environ.setdefault("TORCH_NCCL_USE_COMM_NONBLOCKING", "1")


def device_of_this_worker() -> torch.device:
    """The CUDA device NCCL groups are bound to (eager init): the worker's current one."""
    return torch.device("cuda", torch.cuda.current_device())
