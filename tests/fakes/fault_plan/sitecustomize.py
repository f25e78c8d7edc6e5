"""Test-only: faults at exact points of the runtime, installed in each worker process.

A test puts this directory first on PYTHONPATH (``tests.fakes.fault_plan.env``) and
names its faults in the environment; in worker processes (the agent is left alone) the
hooks go into ``elastic.worker.fault_points`` and ``elastic.checkpoint.durable``:

``FAULT_DIE_ENTERING_ROUND=RANK:FILE``
    The worker of RANK in a round after the first SIGKILLs itself once the round has
    formed at its store and before ``init_process_group``: its peers are left waiting in
    the init, as when a peer dies during the init of a new round.
``FAULT_SHARDED_DIE=POINT:RANK:FILE``
    The worker of RANK SIGKILLs itself at POINT of a sharded commit or sync
    (``replicating`` from commit 5 on, ``resharding`` after the first round).
``FAULT_CHECKPOINT_WRITE_GATE=PATH``
    Every durable write waits (at most an hour) until PATH exists before writing its
    data, and says so first in ``PATH`` + ``.held-step-<step>`` holding its tmp dir's name.

Each SIGKILL happens once per job: the worker creates FILE first (exclusively), and
nobody dies once it exists.
"""

import os
import signal
import time

HELD_PREFIX = ".held-step-"


def _die_once(marker: str) -> None:
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)


def _install() -> None:
    entering = os.environ.get("FAULT_DIE_ENTERING_ROUND")
    sharded = os.environ.get("FAULT_SHARDED_DIE")
    gate = os.environ.get("FAULT_CHECKPOINT_WRITE_GATE")
    if entering or sharded:
        from elastic.worker import fault_points

        if entering:
            rank, marker = entering.split(":", 1)
            fault_points.install("entering_round", lambda round_number, r: round_number > 1 and r == int(rank)
                                 and _die_once(marker))
        if sharded:
            point, rank, marker = sharded.split(":", 2)
            # replicating: from commit 5 on (copies of earlier commits exist); resharding: after
            # the first round (a re-shard of survivors' copies, not the first start's)
            when = {"replicating": lambda commit, round_number: commit >= 5,
                    "resharding": lambda commit, round_number: round_number > 1}[point]
            fault_points.install("sharded", lambda at, r, commit, round_number: at == point and r == int(rank)
                                 and when(commit, round_number) and _die_once(marker))
    if gate:
        from elastic.checkpoint import durable

        def wait_for_gate(step: int, tmp: str) -> None:
            if os.path.exists(gate):
                return
            held = f"{gate}{HELD_PREFIX}{step}"
            with open(held + ".part", "w") as f:
                f.write(os.path.basename(tmp))
            os.rename(held + ".part", held)  # whole or absent for the test that reads it
            deadline = time.monotonic() + 3600
            while not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.1)

        durable.before_write = wait_for_gate


if "ELASTIC_WORKER_WORKER_ID" in os.environ:  # WorkerConfig.worker_id: a worker process
    _install()
