"""A job you can watch (real etcd, a real elastic-run, 2 workers drawing tqdm-like bars):
rank 0's bar redraws reach the console before their line ends, rank 1's do not (the
default --console-ranks), `elastic-run status` shows the step and the time left while the
job runs, and the agent ends with the run's summary."""

from __future__ import annotations

import io
import json
import uuid

import pytest

from elastic.cli.status import main as status_main
from tests.fakes.jobs import ELASTIC_RUN, REPO, Job, wait_until  # noqa: F401

pytestmark = pytest.mark.timeout(180)

BAR_JOB = REPO / "tests" / "fakes" / "bar_job.py"


def _console(job: Job) -> str:
    return job.output.read_bytes().decode(errors="replace")  # Job.text() would read each \r as a line end


def _progress(endpoint: str, job_id: str):
    out = io.StringIO()
    if status_main(["--rdzv-endpoint", endpoint, "--job-id", job_id, "--json"], out=out) != 0:
        return None
    return json.loads(out.getvalue()).get("progress")


def test_bars_live_on_the_console_progress_in_status_and_a_summary_at_the_end(tmp_path, etcd_server):
    endpoint, job_id = etcd_server.endpoint, f"watch-{uuid.uuid4().hex[:10]}"
    release = tmp_path / "release"
    job = Job(tmp_path, ["--rdzv-endpoint", endpoint, "--job-id", job_id, "--host-addr", "127.0.0.1",
                         "--nproc-per-node", "2", "--min-np", "2", "--max-np", "2", "--log-dir", str(tmp_path / "logs"),
                         "--hang-timeout", "off",  # the hold below is no hang
                         str(BAR_JOB), "--steps", "50", "--step-delay", "0.05", "--hold-at", "40",
                         "--release", str(release)])
    try:
        # Held before step 41, its bar's line not ended (the script writes its newline after
        # step 50): the redraws so far are on the console already.
        wait_until(lambda: "\r[rank0]: training: 40/50 steps" in _console(job), 90, "rank 0's bar at 40/50")
        assert "[rank1]: training" not in _console(job)  # rank 1's redraws stay in its log
        progress = wait_until(lambda: (p := _progress(endpoint, job_id)) and p["step"] >= 20 and p, 30,
                              "progress in status")
        assert progress["total_steps"] == 50 and progress["steps_per_s"] > 0 and progress["eta_s"] > 0, progress
        assert progress["failures"] == 0 and progress["lost_s"] == 0, progress
        release.touch()
        assert job.wait(60) == 0, job.text()[-3000:]
    finally:
        job.kill()
    text = _console(job)
    assert "[rank0]: training: 50/50 steps\n" in text and "[rank1]: training: 50/50 steps\n" in text
    summary = text[text.index(f"elastic-run: summary: job {job_id} succeeded after 50 steps in "):].splitlines()
    assert summary[1] == "  no failures, joins or leaves", summary
    assert summary[2] == f"  timeline: elastic-run timeline {tmp_path / 'logs'} -o timeline.png", summary
    rank1_log = next((tmp_path / "logs").glob("worker-*.w1.log")).read_bytes()
    assert b"\rtraining: 40/50 steps\r" in rank1_log  # the log has every redraw
