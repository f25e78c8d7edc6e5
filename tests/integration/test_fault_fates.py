"""What an exited worker means to its agent, end to end: real etcd, a real agent, real gloo workers.

Every rank out of memory at the same step is one deterministic fault, not four broken
processes: the job fails within a minute, naming it, instead of replacing what it can
and waiting for the rendezvous timeout with too few workers. A worker that exits 0
before its training function returned (``os._exit(0)`` mid-training) did not finish
the job: it is a lost worker, replaced, and the job trains to its end.
"""

from __future__ import annotations

import os
import uuid

import pytest

from elastic.contract.exit_codes import JOB_FAILED
from tests.fakes.jobs import Job, one_worker_hosts

pytestmark = pytest.mark.timeout(400)

OOM = "OutOfMemoryError: out of memory at step 5: tried to allocate 64.00 GiB"


def _events(job, name):
    return [e for e in job.events() if e["event"] == name]


def test_every_rank_out_of_memory_at_one_step_fails_the_job_within_a_minute(tmp_path):
    launcher = ["--np", "4", "--max-restarts", "1", "--collective-timeout", "20"]
    script = ["--steps", "100000", "--step-delay", "0.02", "--oom-step", "5"]
    job = Job(tmp_path, Job.train_args(tmp_path / "out", tmp_path / "logs", launcher, script))
    try:
        code = job.wait(300)
    finally:
        job.kill()
    ended = os.path.getmtime(job.output)  # the job's last line
    text = job.text()
    raised = [float((tmp_path / "out" / name).read_text()) for name in os.listdir(tmp_path / "out")
              if name.startswith("oom-")]
    assert raised, text[-3000:]
    assert code == JOB_FAILED, text[-3000:]  # not a user error: the code is fine, the batch does not fit
    assert ended - min(raised) < 60, (ended - min(raised), text[-3000:])
    failed = [line for line in text.splitlines() if line.startswith("elastic-run: job ") and " failed: " in line]
    assert len(failed) == 1 and OOM in failed[0] and "cannot help" in failed[0], failed


def test_a_worker_that_exits_0_mid_training_is_replaced_and_the_job_trains_to_its_end(tmp_path):
    launcher = ["--np", "2", "--max-restarts", "1", "--collective-timeout", "20"]
    # --setup-barrier inside: "rank 0 downloads, then a barrier" where it belongs, run by the
    # replacement and the survivor together (test_pre_train_collectives.py: the other place).
    script = ["--steps", "30", "--step-delay", "0.05", "--exit0-rank", "1", "--exit0-step", "5",
              "--setup-barrier", "inside"]
    job = Job(tmp_path, Job.train_args(tmp_path / "out", tmp_path / "logs", launcher, script))
    try:
        code = job.wait(300)
    finally:
        job.kill()
    text = job.text()
    assert code == 0, text[-3000:]
    exited = int((tmp_path / "out" / "exit0-5").read_text())
    assert max(s["step"] for s in job.steps()) == 30, text[-3000:]  # not ended at step 5 as a success
    lost = [e["reason"] for e in _events(job, "failure_detected")]
    assert any("exited 0 before its training function returned" in reason for reason in lost), lost
    assert len(_events(job, "worker_started")) == 3, text[-3000:]  # two, and the replacement
    assert exited not in {s["pid"] for s in job.steps() if s["step"] > 6}
    from tests.fakes.jsonl import read_jsonl  # here, not at the top: a line other branches change

    barriers = read_jsonl(tmp_path / "out" / "barrier.jsonl")
    last = {b["pid"] for b in barriers if b["round"] == max(b["round"] for b in barriers) > 1}
    assert len(last) == 2 and exited not in last, barriers  # the survivor and the replacement


def test_out_of_memory_on_every_host_fails_the_job_when_the_replacements_meet_it_again(
        tmp_path, etcd_server):
    # One worker per host: no agent sees "all of its workers" fail alone (one is not all);
    # each replaces its worker, and the replacement running out again at the same step
    # shows that replacing cannot help.
    job_id = f"oom-{uuid.uuid4().hex[:10]}"
    agents = one_worker_hosts(tmp_path, etcd_server.endpoint, job_id, ["--max-restarts", "1", "--collective-timeout", "20"],
                              ["--steps", "100000", "--step-delay", "0.02", "--oom-step", "5"])
    try:
        codes = [agent.wait(300) for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    texts = [agent.text() for agent in agents]
    assert codes == [JOB_FAILED, JOB_FAILED], [text[-2000:] for text in texts]
    raised = [float((tmp_path / name / "out" / f).read_text()) for name in ("a", "b")
              for f in os.listdir(tmp_path / name / "out") if f.startswith("oom-")]
    ended = max(os.path.getmtime(agent.output) for agent in agents)
    assert ended - min(raised) < 60, (ended - min(raised), [text[-2000:] for text in texts])
    for text in texts:
        failed = [line for line in text.splitlines() if line.startswith(f"elastic-run: job {job_id} failed: ")]
        assert len(failed) == 1 and OOM in failed[0] and "cannot help" in failed[0], text[-2000:]
