"""The end of a job on one host: let the workers finish, but do not wait for ever.

When the job is over (it succeeded, failed or was stopped), the workers get a
moment to end on their own: 10 s after a success, 2 s after a failure. A worker
that says it is writing the final durable checkpoint (rank 0, while the others
have finished: a marker file exists while it writes) gets
``--final-checkpoint-timeout`` instead, because a state of several GB takes longer
than a moment to write; it is stopped only when that runs out. A signal to the
agent stops every worker at once.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Callable

from .workers import Exited, WorkerProcess

log = logging.getLogger(__name__)

_MOMENT_AFTER_SUCCESS_S = 10.0
_MOMENT_AFTER_FAILURE_S = 2.0


def wind_down(
    workers: dict[str, WorkerProcess],
    inbox: "queue.Queue",
    *,
    succeeded: bool,
    final_timeout: float,
    writing: Callable[[str], bool],
    label: Callable[[str], str],
    on_exit: Callable[[Exited], None],
    is_signal: Callable[[object], bool],
) -> None:
    """Return once every live worker has exited (killing those whose time is up).

    ``is_signal(item)``: the inbox item is a signal to the agent. The inbox carries other
    news too (control-channel updates), which changes nothing here.
    """
    moment = _MOMENT_AFTER_SUCCESS_S if succeeded else _MOMENT_AFTER_FAILURE_S
    started = time.monotonic()
    give_up = started + moment + final_timeout + 10.0
    pending = {w for w, p in workers.items() if p.alive}  # until their exit is reported
    busy_until = dict.fromkeys(pending, started)  # when each was last seen writing
    killed: set[str] = set()
    interrupted = False
    while pending and time.monotonic() < give_up:
        now = time.monotonic()
        for worker_id in pending - killed:
            is_writing = succeeded and writing(worker_id)
            if is_writing:
                busy_until[worker_id] = now
            over = now - started >= final_timeout if is_writing else now - busy_until[worker_id] >= moment
            if interrupted or over:
                if is_writing and not interrupted:
                    log.warning("%s still writing the final checkpoint after %.0fs "
                                "(--final-checkpoint-timeout %g): stopping it",
                                label(worker_id), now - started, final_timeout)
                workers[worker_id].kill()
                killed.add(worker_id)
                give_up = min(give_up, now + 5.0)
        try:
            item = inbox.get(timeout=0.2)
        except queue.Empty:
            continue
        proc = workers.get(item.worker_id) if isinstance(item, Exited) else None
        if proc is not None and proc.pid == item.pid:
            # Only reported: the job's fate is decided, nothing to react to any more.
            pending.discard(item.worker_id)
            on_exit(item)
        elif is_signal(item):
            interrupted = True
