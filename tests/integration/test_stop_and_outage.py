"""Job-wide decisions under pressure: simultaneous leaves, and failures while etcd is away.

* Several hosts told to leave at once (a scale-down), each of which alone would
  leave enough workers: the coordinator alone decides that together they go below
  --min-np, the whole job stops at one commit, rank 0 writes a final durable
  checkpoint of exactly that commit, and every agent exits 0.
* A worker killed while etcd is down: nothing fails the job (errors while
  re-forming are failures of the ring, not user errors); the loss is handled as
  soon as etcd is back.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid

import pytest

from checkpoint import load_latest
from tests.fakes.jobs import Job, wait_until

pytestmark = pytest.mark.timeout(300)


def agents(tmp_path, endpoint, names, *, extra=(), script_extra=()):
    job_id = f"stop-{uuid.uuid4().hex[:10]}"
    common = ["--rdzv-endpoint", endpoint, "--job-id", job_id, "--host-addr", "127.0.0.1",
              "--collective-timeout", "60", *extra]
    out, logs = tmp_path / "out", tmp_path / "logs"
    script = ["--steps", "100000", "--step-delay", "0.03", *script_extra]
    jobs = {}
    for name, nproc in names:
        jobs[name] = Job(tmp_path, Job.train_args(out, logs, [*common, "--host-id", f"host-{name}",
                                                             "--nproc-per-node", str(nproc)], script), name=name)
        if len(jobs) == 1:
            first = jobs[name]
            wait_until(lambda: any(e["event"] == "member_joined" for e in first.events()), 60, "first agent")
    return jobs


def test_simultaneous_leaves_below_min_np_stop_the_job_at_one_commit(tmp_path, etcd_server):
    ckpt = tmp_path / "ckpt"
    jobs = agents(tmp_path, etcd_server.endpoint, [("a", 1), ("b", 1), ("c", 1)],
                  extra=["--min-np", "2", "--max-np", "3", "--checkpoint-dir", str(ckpt),
                         "--checkpoint-every", "1000000"])
    a = jobs["a"]
    wait_until(lambda: sum(1 for s in a.steps() if s["world"] == 3) >= 10, 180, "10 steps of the 3-worker ring")
    # Each of b and c alone would leave 2 >= --min-np workers; together they leave 1.
    for name in ("b", "c"):
        jobs[name].proc.send_signal(signal.SIGTERM)
    for name, job in jobs.items():
        assert job.wait(120) == 0, f"{name}:\n{job.text()[-3000:]}"

    events = a.events()
    finished = [e for e in events if e["event"] == "job_finished"]
    assert len(finished) == 3 and all(e["status"] == "stopping" for e in finished), finished
    assert not [e for e in events if e["event"] == "failure_detected"]
    # Every worker stopped after the same step, and that step is the final checkpoint.
    steps = a.steps()
    last = {}
    for s in steps:
        last[s["pid"]] = max(last.get(s["pid"], 0), s["step"])
    assert len(set(last.values())) == 1, last
    found = load_latest(str(ckpt))
    assert found is not None, "no final durable checkpoint"
    tree, manifest = found
    assert tree["values"]["step"] == next(iter(last.values()))


def test_a_worker_killed_while_etcd_is_down_is_handled_when_it_returns(tmp_path, fresh_etcd):
    jobs = agents(tmp_path, fresh_etcd.endpoint, [("a", 3)],
                  extra=["--min-np", "2", "--max-np", "3", "--rdzv-ttl", "10"],
                  script_extra=["--stop-file", str(tmp_path / "stop")])
    a = jobs["a"]
    a.wait_for_step(10, timeout=120)
    fresh_etcd.kill()
    victim = a.worker_pid(2)
    os.kill(victim, signal.SIGKILL)
    killed_at = time.time()
    # The survivors' ring broke while etcd is away, longer than one request retries.
    wait_until(lambda: any(e["event"] == "worker_exited" for e in a.events()), 30, "the agent to see the exit")
    down_until = time.monotonic() + 12.0
    wait_until(lambda: time.monotonic() >= down_until or a.proc.poll() is not None, 20, "the outage")
    assert a.proc.poll() is None, "the agent gave up during the etcd outage:\n" + a.text()[-3000:]
    fresh_etcd.restart()
    restarted_at = time.time()
    steps = wait_until(lambda: [s for s in a.steps() if s["t"] > restarted_at and s["world"] == 2], 60,
                       "a step of the 2-worker ring after etcd returned")
    print(f"\nnext step {min(s['t'] for s in steps) - restarted_at:.2f}s after etcd returned "
          f"({restarted_at - killed_at:.1f}s outage)")
    (tmp_path / "stop").touch()
    assert a.wait(120) == 0, a.text()[-3000:]
    events = a.events()
    assert not [e for e in events if e.get("user_error")], [e for e in events if e.get("user_error")]
    assert [e["status"] for e in events if e["event"] == "job_finished"] == ["succeeded"]
