"""A Horovod script without hvd.elastic.run (hvd.init, DistributedOptimizer,
broadcast_parameters: Horovod's own examples) loses a worker to a real SIGKILL under
--horovod-shim: as under torchrun, every worker is restarted and resumes from the script's
own snapshot; with no restart left the job fails at once, naming the killed worker, as a
failure of the job (exit 1), not of the user's code. Before: the agent waited 600 s
("0 of 2 present"), or the restarted workers failed with NoRingBeforeRun (exit 3)."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from tests.fakes.jobs import REPO, Job, wait_until

# About 28 CPU s (six worker starts): CI runs it with the slow tests, make test does not.
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

SCRIPT = str(REPO / "tests" / "fakes" / "hvd_plain.py")


def _pid_of(job: Job, rank: int) -> int:
    found = wait_until(lambda: re.findall(rf"rank {rank} pid (\d+) size 2", job.text()), 120, f"rank {rank}")
    return int(found[-1])


def test_a_horovod_script_without_its_elastic_api_restarts_every_worker_or_fails_at_once(tmp_path):
    out, snapshot = tmp_path / "result.json", tmp_path / "snapshot.pt"
    job = Job(tmp_path, ["--np", "2", "--max-restarts", "1", "--horovod-shim", "--log-dir", str(tmp_path / "logs"),
                         SCRIPT, "--steps", "160", "--snapshot", str(snapshot), "--out", str(out)], name="restarts")
    first = {rank: _pid_of(job, rank) for rank in (0, 1)}
    wait_until(snapshot.exists, 120, "the first snapshot")
    os.kill(first[1], signal.SIGKILL)
    assert job.wait(240) == 0, job.text()[-3000:]
    result = json.loads(out.read_text())
    assert result["size"] == 2 and result["resumed_from"] >= 20  # both restarted, from the script's snapshot
    started = [e for e in job.events() if e["event"] == "worker_started"]
    assert len(started) == 4 and not {e["pid"] for e in started[2:]} & set(first.values())  # every worker anew
    assert "NoRingBeforeRun" not in job.text()
    assert "every worker restarted (torchrun-style)" in job.text()  # the summary counts the recovery

    alone = Job(tmp_path, ["--np", "2", "--horovod-shim", SCRIPT, "--steps", "100000"], name="no-restart")
    victim = _pid_of(alone, 1)
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    assert alone.wait(60) == 1, alone.text()[-3000:]  # the job's failure (1), not the user's (3)
    assert time.monotonic() - killed_at < 30  # at once, not after --rdzv-timeout (600 s)
    failed = re.search(r"^elastic-run: job local failed: (.*)$", alone.text(), re.M)
    assert failed and ".w1 died (signal 9); --max-restarts 0 used up" in failed.group(1), alone.text()[-3000:]
