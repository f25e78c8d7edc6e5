"""ShardedState end to end: real etcd, real gloo workers running FSDP2 in float64, whose
final parameters must equal a plain single-process run (tests/fakes/sharded_job.py)
within 1e-9 whatever the ring went through: a rank killed, a host lost, a joiner.

No test here passes --checkpoint-dir: whatever a survivor resumes from came from
the memory of the workers (their own shards and the replicas they keep)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

import pytest
import torch

from tests.fakes import fault_plan
from tests.fakes.jobs import read_jsonl, wait_until
from tests.fakes.sharded_runs import SHARDED_JOB, assert_equals_reference, reference, reshards, start, worlds

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow  # about 50 s: make test stays under 15 min
def test_rank0_killed_mid_step_survivors_reshard_in_memory_and_match_a_single_process(tmp_path):
    steps = 12
    job = start(tmp_path, ["--np", "3", "--min-np", "2", "--collective-timeout", "20"],
                ["--steps", str(steps), "--kill-rank", "0", "--kill-step", "5"])
    assert job.wait(240) == 0, job.text()[-3000:]
    assert (tmp_path / "out" / "killed-5").exists()
    assert worlds(job) == [3, 2]
    # The survivors went on from commit 4 (step 5 was trained but never committed by rank 0),
    # re-sharded from 3 to 2 ranks: rank 0's shard came from its replica.
    assert sum("re-sharded commit 4 (world 3 -> 2)" in line for line in reshards(job)) == 2, job.text()[-3000:]
    reforms = [e for e in job.events() if e["event"] == "reform_done"]
    assert len(reforms) == 2 and all(e["failed"] and e["commit"] == 4 for e in reforms)
    assert_equals_reference(tmp_path, steps)


@pytest.mark.extended  # long: by hand (`make test-extended`), not in CI, which must stay within its time
def test_a_plain_worker_lost_and_replaced_worlds_4_3_4(tmp_path):
    steps = 14
    job = start(tmp_path, ["--np", "4", "--min-np", "2", "--max-restarts", "1", "--collective-timeout", "20"],
                ["--steps", str(steps), "--kill-rank", "2", "--kill-step", "4", "--hold-below-world", "4",
                 "--grow-back"])
    assert job.wait(280) == 0, job.text()[-3000:]
    assert worlds(job)[:2] == [4, 3] and worlds(job)[-1] == 4, worlds(job)
    lines = reshards(job)
    assert any("(world 4 -> 3)" in line for line in lines), job.text()[-3000:]
    assert any("(world 3 -> 4)" in line for line in lines), job.text()[-3000:]
    assert_equals_reference(tmp_path, steps)


@pytest.mark.slow
def test_a_whole_host_lost_with_one_replica_nothing_read_from_disk(tmp_path, etcd_server):
    """Two hosts (agents) of two workers; one host's agent and workers die at once. Every
    shard they held is on the other host (--shard-replicas 1 puts copies on other hosts)."""
    steps = 12
    job_id = f"sharded-{uuid.uuid4().hex[:8]}"
    common = ["--rdzv-endpoint", etcd_server.endpoint, "--job-id", job_id, "--host-addr", "127.0.0.1",
              "--nproc-per-node", "2", "--min-np", "2", "--max-np", "4", "--collective-timeout", "20",
              "--shard-replicas", "1"]
    # Rank 3 (on the second host to join) kills its own agent, hence its host, at step 5.
    script = ["--steps", str(steps), "--kill-rank", "3", "--kill-step", "5", "--kill-agent", "--step-delay", "0.1",
              "--hold-below-world", "4"]
    a = start(tmp_path, [*common, "--host-id", "host-a"], script, name="a")
    wait_until(lambda: any(e["event"] == "member_joined" for e in a.events()), 60, "a to register")
    b = start(tmp_path, [*common, "--host-id", "host-b"], script, name="b")
    assert a.wait(280) == 0, a.text()[-3000:]
    b.proc.wait(30)
    assert (tmp_path / "out" / "killed-5").exists()
    formed = worlds(a)
    assert formed[-1] == 2 and 4 in formed, formed
    assert any("(world 4 -> 2)" in line for line in reshards(a)), a.text()[-3000:]
    pids = read_jsonl(tmp_path / "out" / "pids.jsonl")
    assert {p["world"] for p in pids} >= {4, 2}
    assert_equals_reference(tmp_path, steps)


@pytest.mark.extended  # long: by hand (`make test-extended`), not in CI, which must stay within its time
@pytest.mark.timeout(480)
def test_two_of_three_hosts_lost_resume_from_the_durable_checkpoint_which_plain_fsdp2_loads(tmp_path, etcd_server):
    """--shard-replicas 1 covers one lost host; two lost at once take every copy of a shard:
    the survivor resumes in-process from the newest durable (DCP) checkpoint. That checkpoint
    format is torch's: a plain FSDP2 script under torchrun loads it at another world size."""
    steps = 12
    job_id = f"sharded-{uuid.uuid4().hex[:8]}"
    checkpoints = tmp_path / "ck"
    common = ["--rdzv-endpoint", etcd_server.endpoint, "--job-id", job_id, "--host-addr", "127.0.0.1",
              "--nproc-per-node", "1", "--min-np", "1", "--max-np", "3", "--collective-timeout", "20",
              "--shard-replicas", "1", "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "3"]
    script = ["--steps", str(steps), "--kill-rank", "1,2", "--kill-step", "8", "--kill-agent",
              "--hold-below-world", "3"]
    a = start(tmp_path, [*common, "--host-id", "host-a"], script, name="a")
    wait_until(lambda: any(e["event"] == "member_joined" for e in a.events()), 60, "a to register")
    others = [start(tmp_path, [*common, "--host-id", f"host-{n}"], script, name=n) for n in "bc"]
    assert a.wait(280) == 0, a.text()[-3000:]
    for other in others:
        other.proc.wait(30)
    text = a.text()
    assert "is lost (more hosts than --shard-replicas 1 covers): resuming from durable checkpoint step 6" in text, \
        text[-3000:]
    assert worlds(a)[-1] == 1
    assert_equals_reference(tmp_path, steps)

    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTIC_", "MASTER_", "RANK", "WORLD_"))}
    plain = tmp_path / "plain"
    plain.mkdir()
    # Its own session: on a timeout the whole group goes (torchrun's workers outlive a killed torchrun).
    torchrun = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                 "2", str(SHARDED_JOB), "--load-dcp", str(checkpoints / "step-000000012"),
                                 "--out", str(plain)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        assert torchrun.wait(150) == 0
    finally:
        if torchrun.poll() is None:
            os.killpg(torchrun.pid, signal.SIGKILL)
            torchrun.wait(10)
    loaded = torch.load(plain / "final.pt", weights_only=True)
    expected = reference(tmp_path, steps)
    for name, value in expected.items():
        assert torch.allclose(loaded[name], value, rtol=0, atol=1e-9), name


@pytest.mark.extended  # long: by hand (`make test-extended`), not in CI, which must stay within its time
def test_a_worker_killed_while_its_commit_replicates_the_previous_commit_survives(tmp_path):
    """Rank 1 dies right after posting commit 5's copies: its shard of 5 may never have
    arrived anywhere, so the ring goes on from a commit every shard of which survived."""
    steps = 10
    marker = tmp_path / "died-replicating"
    job = start(tmp_path, ["--np", "3", "--min-np", "2", "--collective-timeout", "20"], ["--steps", str(steps)],
                env=fault_plan.env(FAULT_SHARDED_DIE=f"replicating:1:{marker}"))
    assert job.wait(240) == 0, job.text()[-3000:]
    assert marker.exists() and worlds(job) == [3, 2]
    assert any("(world 3 -> 2)" in line for line in reshards(job)), job.text()[-3000:]
    assert_equals_reference(tmp_path, steps)


@pytest.mark.slow
def test_a_worker_killed_inside_a_reshard_with_two_replicas_nothing_is_lost(tmp_path):
    """Worlds 4 -> 3 -> 2: rank 1 dies mid-step, then rank 2 of the new ring dies while the
    re-shard's transfers are in flight. With --shard-replicas 2 the old ring's copies,
    kept until the new ring is replicated, still cover every shard."""
    steps = 10
    marker = tmp_path / "died-resharding"
    job = start(tmp_path, ["--np", "4", "--min-np", "2", "--collective-timeout", "20", "--shard-replicas", "2"],
                ["--steps", str(steps), "--kill-rank", "1", "--kill-step", "4"],
                env=fault_plan.env(FAULT_SHARDED_DIE=f"resharding:2:{marker}"))
    assert job.wait(280) == 0, job.text()[-3000:]
    assert marker.exists()
    assert worlds(job)[:2] == [4, 3] and worlds(job)[-1] == 2, worlds(job)
    assert any("(world 4 -> 2)" in line for line in reshards(job)), job.text()[-3000:]
    assert_equals_reference(tmp_path, steps)
