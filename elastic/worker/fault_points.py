"""Faults injected at exact points of the runtime, for tests only.

Each is off unless its ``ELASTIC_TEST_*`` variable is set (the agent passes its
environment on to the workers), so a test can make a worker die at a point that
no timing from outside could hit reliably.

``ELASTIC_TEST_DIE_ENTERING_ROUND=RANK:FILE``
    The worker that holds RANK in a round after the first SIGKILLs itself once the
    round has formed at its store (every worker arrived) and before
    ``init_process_group``: its peers are left waiting in the init for an address it
    never publishes, as when a peer dies during the init of a new round. Once per
    job: the worker creates FILE first (exclusively), and nobody dies once it exists.

``ELASTIC_TEST_SHARDED_DIE=POINT:RANK:FILE``
    The worker of RANK SIGKILLs itself at POINT of a sharded commit or sync
    (``replicating``: from commit 5 on, a commit's copies are posted to the replicas,
    not yet arrived; ``resharding``: a re-shard after the first round has posted its
    transfers, not yet complete), once per job as above.
"""

from __future__ import annotations

import os
import signal

DIE_ENTERING_ROUND = "ELASTIC_TEST_DIE_ENTERING_ROUND"
DIE_SHARDED = "ELASTIC_TEST_SHARDED_DIE"


def entering_round(round_number: int, rank: int) -> None:
    spec = os.environ.get(DIE_ENTERING_ROUND)
    if not spec or round_number <= 1:
        return
    wanted, marker = spec.split(":", 1)
    if int(wanted) == rank:
        _die_once(marker)


def sharded(point: str, rank: int) -> None:
    spec = os.environ.get(DIE_SHARDED)
    if not spec:
        return
    wanted, wanted_rank, marker = spec.split(":", 2)
    if wanted == point and int(wanted_rank) == rank:
        _die_once(marker)


def _die_once(marker: str) -> None:
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)
