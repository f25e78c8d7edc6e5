"""Seeing the job, end to end: the timeline of a real run with a kill and a join, and
a real run under --chaos-kill-every with its recovery report."""

from __future__ import annotations

import os
import re
import signal
import struct
import subprocess
import uuid

import pytest

from elastic.timeline.cli import load
from tests.fakes.jobs import ELASTIC_RUN, REPO, Job, wait_until

pytestmark = pytest.mark.timeout(300)


def agent(tmp_path, endpoint, job_id, nproc, script_args, *, name):
    launcher = ["--rdzv-endpoint", endpoint, "--job-id", job_id, "--nproc-per-node", str(nproc),
                "--min-np", "2", "--max-np", "3"]
    return Job(tmp_path, Job.train_args(tmp_path / "out", tmp_path / "logs", launcher, script_args), name=name)


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def test_timeline_of_a_run_with_a_kill_and_a_join(tmp_path, etcd_server):
    job_id = f"timeline-{uuid.uuid4().hex[:8]}"
    # Once shrunk, the ring commits in lockstep without training until it has 3 workers
    # again, so the job cannot end before the joiner (slow to start under load) arrives.
    args = ["--epochs", "1", "--dataset-size", "360", "--step-delay", "0.05", "--hold-below-world", "3"]
    first = agent(tmp_path, etcd_server.endpoint, job_id, 3, args, name="first")
    first.wait_for_step(8)
    os.kill(first.worker_pid(2), signal.SIGKILL)
    wait_until(lambda: any(e["event"] == "reform_done" for e in first.events()), 60, "the shrink")
    second = agent(tmp_path, etcd_server.endpoint, job_id, 1, args, name="second")
    assert first.wait(240) == 0, first.text()[-3000:]
    assert second.wait(60) == 0, second.text()[-3000:]

    png = tmp_path / "timeline.png"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")} | {"PYTHONPATH": str(REPO)}
    done = subprocess.run([*ELASTIC_RUN, "timeline", str(first.log_dir), "-o", str(png)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    width, height = png_size(png)
    assert 1000 <= width <= 2000 and 500 <= height <= 2000, (width, height)

    timeline = load(str(first.log_dir))
    [killed] = timeline.failures
    assert killed.kind == "killed" and killed.worker.endswith(".w2")
    assert [c.kind for c in timeline.changes] == ["joined"]
    broke = [r for r in timeline.reformations if r.failed]
    switched = [r for r in timeline.reformations if not r.failed]
    assert broke and broke[0].cause is killed and broke[0].world_size == 2
    assert switched and switched[-1].world_size == 3
    assert [w for _, w in timeline.world][:3] == [3, 2, 3]
    assert len(timeline.lanes) == 4
    # The victim's last second of steps dies with it (elastic/step_log.py): only the others must have steps.
    assert all(lane.steps > 0 for lane in timeline.lanes if lane.worker != killed.worker)
    assert done.stdout.startswith(f"{png}: 3 workers, 1 killed at ")
    assert "1 host joined at" in done.stdout and "succeeded" in done.stdout


@pytest.mark.slow  # the default run's budget holds the timeline test above; this is a second full job
def test_chaos_kills_a_worker_and_reports_its_recovery(tmp_path):
    # No replacement allowed and min-np 2: the first kill (3 -> 2) is the only one the
    # job survives, so the monkey must kill exactly once and then leave the job alone.
    job = Job(tmp_path, Job.train_args(
        tmp_path / "out", tmp_path / "logs",
        ["--np", "3", "--min-np", "2", "--chaos-kill-every", "2", "--chaos-seed", "7"],
        ["--steps", "250", "--step-delay", "0.03"]))
    assert job.wait(240) == 0, job.text()[-3000:]
    text = job.text()
    kills = [e for e in job.events() if e["event"] == "chaos_kill"]
    assert len(kills) == 1, text[-3000:]
    assert "chaos: 1 kill, 1 recovered; to the next step: median" in text, text[-3000:]
    [row] = re.findall(r"^  1 +[\d.]+  (\S+) \(\d\) +([\d.]+) .* ([\d.]+) +(\d+)  -> (\d+), 2$", text, re.M)
    assert row[0] == kills[0]["worker"]
    exits = [e for e in job.events() if e["event"] == "worker_exited" and e.get("signal") == 9]
    assert [e["worker"] for e in exits] == [kills[0]["worker"]]
    steps = [s["step"] for s in job.steps() if s["rank"] == 0]
    assert max(steps) == 250
