"""`elastic-run status` on a real job (real etcd, a real elastic-run with 2 gloo workers):
its JSON while the job runs and after it ended, and one line for an unknown job."""

from __future__ import annotations

import io
import json
import subprocess
import uuid

import pytest

from elastic.cli.status import main as status_main
from elastic.rendezvous import RUNNING, SUCCEEDED, JobKeys, JobStatus, keep_ended_job
from elastic.rendezvous.etcd import Etcd
from tests.fakes.jobs import ELASTIC_RUN, REPO, Job, wait_until

pytestmark = pytest.mark.timeout(300)


def status(endpoint: str, job_id: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([*ELASTIC_RUN, "status", "--rdzv-endpoint", endpoint, "--job-id", job_id, *extra],
                          cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=240)


def status_json(endpoint: str, job_id: str) -> dict:
    """The command's own main, in this process: a fresh `elastic-run` spends most of its
    time importing torch, minutes on a loaded CI machine (the unknown-job case below
    runs it as a process)."""
    out = io.StringIO()
    assert status_main(["--rdzv-endpoint", endpoint, "--job-id", job_id, "--json"], out=out) == 0
    assert len(out.getvalue().splitlines()) == 1, out.getvalue()  # one JSON object
    return json.loads(out.getvalue())


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


def test_an_ended_jobs_history_is_put_on_one_lease_once_and_then_expires(etcd):
    keys = JobKeys(f"history-{uuid.uuid4().hex[:10]}")
    etcd.put(keys.status, JobStatus(SUCCEEDED, "worker w0 finished").to_json())
    etcd.put(keys.plan, b'{"round": 1}')
    etcd.put(keys.round(1), b'{"round": 1}')
    etcd.put(keys.request("w1"), b'{"round": 1, "reason": "late"}')
    assert keep_ended_job(etcd, keys, keep_s=3) is True
    assert keep_ended_job(etcd, keys, keep_s=3) is False  # a second agent leaving finds it done
    kvs, _ = etcd.get_prefix(keys.prefix)
    assert sorted(kv.key for kv in kvs) == sorted([keys.plan, keys.round(1), keys.status])  # the request went
    assert len({kv.lease for kv in kvs}) == 1 and kvs[0].lease
    wait_until(lambda: not etcd.get_prefix(keys.prefix)[0], 30, "the kept keys to expire")


def test_a_running_jobs_keys_are_left_alone(etcd):
    keys = JobKeys(f"history-{uuid.uuid4().hex[:10]}")
    etcd.put(keys.plan, b'{"round": 1}')
    assert keep_ended_job(etcd, keys, keep_s=3) is False  # no status yet: running
    etcd.put(keys.status, JobStatus(RUNNING).to_json())
    assert keep_ended_job(etcd, keys, keep_s=3) is False
    assert all(not kv.lease for kv in etcd.get_prefix(keys.prefix)[0])
