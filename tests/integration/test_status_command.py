"""`elastic-run status` on a real job (real etcd, a real elastic-run with 2 gloo workers):
its JSON while the job runs and after it ended, and one line for an unknown job."""

from __future__ import annotations

import json
import subprocess
import uuid

import pytest

from rendezvous import JobKeys
from rendezvous.etcd import Etcd
from tests.fakes.jobs import ELASTIC_RUN, REPO, Job, wait_until

pytestmark = pytest.mark.timeout(300)


def status(endpoint: str, job_id: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([*ELASTIC_RUN, "status", "--rdzv-endpoint", endpoint, "--job-id", job_id, *extra],
                          cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=60)


def status_json(endpoint: str, job_id: str) -> dict:
    done = status(endpoint, job_id, "--json")
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 1, done.stdout  # one JSON object
    return json.loads(done.stdout)


def test_status_json_while_running_and_after_the_end_and_one_line_for_an_unknown_job(tmp_path, etcd_server):
    endpoint, job_id = etcd_server.endpoint, f"status-{uuid.uuid4().hex[:10]}"
    stop = tmp_path / "stop"
    job = Job(tmp_path, Job.train_args(
        tmp_path / "out", tmp_path / "logs",
        ["--rdzv-endpoint", endpoint, "--job-id", job_id, "--host-addr", "127.0.0.1", "--host-id", "status-host",
         "--nproc-per-node", "2", "--min-np", "2", "--max-np", "2"],
        ["--steps", "100000", "--step-delay", "0.02", "--stop-file", str(stop)]))
    try:
        job.wait_for_step(3)
        running = status_json(endpoint, job_id)
        assert running["state"] == "running" and running["round"] == 1 and running["world_size"] == 2, running
        [member] = running["members"]
        assert member["host"] == "status-host" and member["addr"] == "127.0.0.1" and member["coordinator"]
        assert sorted(w["rank"] for w in member["workers"]) == [0, 1]
        assert running["coordinator"] == member["member_id"]
        assert [(r["round"], r["world_size"]) for r in running["rounds"]] == [(1, 2)]
        assert running["rounds"][0]["reason"] == "max_np=2 workers present"
        stop.touch()
        assert job.wait(120) == 0, job.text()[-3000:]
    finally:
        job.kill()

    ended = status_json(endpoint, job_id)
    assert ended["state"] == "succeeded" and ended["reason"].endswith("finished"), ended
    assert ended["members"] == [] and ended["round"] == 1 and ended["world_size"] == 2
    assert ended["rounds"][0]["round"] == 1
    # Kept for a day (the lease the agent put the history on when it left), then gone.
    assert 23 * 3600 < ended["history_expires_in"] <= 24 * 3600, ended
    with Etcd(etcd_server.config()) as etcd:
        kvs, _ = etcd.get_prefix(JobKeys(job_id).prefix)
        assert kvs and all(kv.lease for kv in kvs), [(kv.key, kv.lease) for kv in kvs]

    unknown = status(endpoint, f"nosuch-{uuid.uuid4().hex[:6]}")
    assert unknown.returncode == 1 and unknown.stdout == ""
    assert len(unknown.stderr.splitlines()) == 1 and "no job nosuch-" in unknown.stderr, unknown.stderr
