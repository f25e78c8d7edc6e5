"""What the program tests share: where the programs are, and killing a worker from outside.

The programs are others' (or written in their pattern): they report nothing to the test
but their files and their console, so a test finds a worker's pid in the agent's
events.jsonl (`worker_started`) and SIGKILLs it, as a crash would.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch

from tests.fakes.jobs import Job, read_jsonl, wait_until

PROGRAMS = Path(__file__).resolve().parent


def live_workers(job: Job) -> list[dict]:
    """The `worker_started` events of `job` whose process is still alive, oldest first."""
    return [e for e in job.events() if e["event"] == "worker_started" and _alive(e["pid"])]


def worker_pid(job: Job, rank: int, timeout: float = 120) -> int:
    """The pid of the live worker that started with `rank` (waiting for it to start)."""
    worker = wait_until(lambda: next((e for e in live_workers(job) if e["rank"] == rank), None), timeout,
                        f"a live worker of rank {rank}")
    return worker["pid"]


def kill_when(job: Job, rank: int, ready, timeout: float, what: str) -> None:
    """SIGKILL the worker of `rank` as soon as `ready()` holds (its pid is looked up first, so
    the kill follows the condition within one poll, even in a fast program)."""
    pid = worker_pid(job, rank, timeout)
    wait_until(ready, timeout, what, interval=0.02)
    assert _alive(pid), f"worker {pid} (rank {rank}) ended before {what}: the kill came too late"
    os.kill(pid, signal.SIGKILL)


def check_restarted_equal_to_plain(job: Job, world: int, resumed: str, steps: Path, out: Path, plain_run) -> None:
    """A torchrun-semantics job killed once: every worker was started twice, the program said
    ``resumed``, every step it logged in ``steps`` (re-run ones included) had the plain run's
    learning rate, and its float64 weights at ``out`` equal the plain run's (1e-12).
    ``plain_run()`` gives (final weights, {step: lr})."""
    assert job.wait(200) == 0, job.text()[-3000:]
    assert len([e for e in job.events() if e["event"] == "worker_started"]) == 2 * world, job.text()[-3000:]
    assert resumed in job.text(), job.text()[-3000:]
    expected, lrs = plain_run()
    logged = read_jsonl(steps)
    assert sorted({r["step"] for r in logged}) == sorted(lrs)
    for record in logged:  # steps the kill cut short were trained again, each time with the same rate
        assert record["lr"] == lrs[record["step"]], record
    final = torch.load(out, weights_only=True)
    for name, value in expected.items():
        assert torch.allclose(final[name], value, rtol=0, atol=1e-12), (name, (final[name] - value).abs().max())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
