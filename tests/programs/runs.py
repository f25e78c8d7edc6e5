"""What the program tests share: where the programs are, and killing a worker from outside.

The programs are others' (or written in their pattern): they report nothing to the test
but their files and their console, so a test finds a worker's pid in the agent's
events.jsonl (`worker_started`) and SIGKILLs it, as a crash would.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from tests.fakes.jobs import Job, wait_until

PROGRAMS = Path(__file__).resolve().parent


def live_workers(job: Job) -> list[dict]:
    """The `worker_started` events of `job` whose process is still alive, oldest first."""
    return [e for e in job.events() if e["event"] == "worker_started" and _alive(e["pid"])]


def kill_worker(job: Job, rank: int) -> int:
    """SIGKILL the live worker that started with `rank`; its pid."""
    worker = wait_until(lambda: next((e for e in live_workers(job) if e["rank"] == rank), None), 60,
                        f"a live worker of rank {rank}")
    os.kill(worker["pid"], signal.SIGKILL)
    return worker["pid"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
