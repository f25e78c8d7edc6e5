"""Hybrid sharding (HSDP) on two namespaced hosts, one job through every kind of loss.

Two hosts (network namespaces on a bridge, etcd on the bridge) of two workers: a 2 x 2
mesh, replica groups of 2 shards, one group per host (tests/fakes/hybrid_job.py: float64,
four FSDP units, AdamW, a StepLR, gradient clipping; min_groups=1, so one complete group
goes on by itself). One run sees, in order:

1. the kill of rank 0 (a worker of host a) after step 3: host b's group goes on at once,
   nothing moves; host a's survivor (rank 0 now, the rank that decides switches) waits
   as a spare, holding its shards;
2. a join that refills the group: host a's agent replaces the worker, and at a commit
   the pair takes its shards from host b's group over the ring (not from disk);
3. the loss of host b (its agent and workers SIGKILLed) after step 6: host a's group goes
   on, nothing moves;
4. a total loss (host a's agent killed) after step 9;
5. a resume from the newest durable (DCP) checkpoint at another mesh shape: one host of
   4 workers with groups of 3, a 1 x 3 mesh and a spare, which finishes with the others.

The final parameters equal a plain single-process run at the same global batch within
1e-12 (a plain HSDP run equals that run within 6e-17: tests/integration/test_hsdp_mesh.py).
"""

from __future__ import annotations

import re
import uuid

import pytest

from tests.fakes.jobs import wait_until
from tests.integration.test_hybrid_sharded import (HYBRID_JOB, assert_equals_reference, mesh_lines, restored,
                                                   start)

pytestmark = pytest.mark.timeout(420)

STEPS = 12


def test_kill_spare_refill_host_loss_total_loss_and_a_resume_at_another_shape(netns_hosts, tmp_path):
    hosts = netns_hosts(2)
    job_id = f"hybrid-hosts-{uuid.uuid4().hex[:8]}"
    checkpoints = tmp_path / "ck"
    script = ["--steps", str(STEPS), "--min-groups", "1", "--hold-at", "0:4", "--kill-at", "0:3", "--hold-at", "3:4",
              "--kill-at", "1:6:host", "--kill-at", "0:9:host"]
    jobs = []
    for host in hosts:
        args = ["--rdzv-endpoint", hosts.etcd_endpoint, "--job-id", job_id, "--host-id", host.name,
                "--host-addr", host.addr, "--nproc-per-node", "2", "--min-np", "2", "--max-np", "4",
                "--collective-timeout", "20", "--max-restarts", "1", "--checkpoint-dir", str(checkpoints),
                "--checkpoint-every", "4", "--log-dir", str(tmp_path / host.name / "logs"), str(HYBRID_JOB),
                "--out", str(tmp_path / "out"), *script]
        jobs.append(host.job(tmp_path / host.name, args, name="agent"))
        if len(jobs) == 1:  # registered first: leads, holds rank 0
            wait_until(lambda: any(e["event"] == "member_joined" for e in jobs[0].events()), 60, "host a")
    a, b = jobs
    try:
        a.proc.wait(300)  # host a's agent is killed by its own worker after step 9: the total loss
    finally:
        for job in jobs:
            if job.proc.poll() is None:
                job.kill()
    assert (tmp_path / "out" / "killed-9").exists(), a.text()[-4000:]
    text = a.text()
    shapes = [m.split(": ", 1)[1] for m in mesh_lines(a)]
    shapes = shapes[shapes.index("2x2 groups [[0, 1], [2, 3]]"):]  # (host a may have formed a ring of its own first)
    assert shapes == ["2x2 groups [[0, 1], [2, 3]]", "1x2 groups [[1, 2]], spares [0]",
                      "2x2 groups [[0, 3], [1, 2]]", "1x2 groups [[0, 1]]"], text[-4000:]
    # 1 and 3: the kill and the host loss moved nothing; 2: host a's pair took host b's copies.
    on_b, on_a = restored(b), restored(a)
    assert [mb for c, mesh, mb in on_b] == [0.0, 0.0, 0.0, 0.0], b.text()[-3000:]
    refill = [mb for c, mesh, mb in on_a if mesh.startswith("2x2")]
    assert len(refill) == 2 and all(mb > 0 for mb in refill), text[-3000:]
    assert [mb for c, mesh, mb in on_a if mesh == "1x2 groups [[0, 1]]"] == [0.0, 0.0], text[-3000:]
    spare_log = "".join(p.read_text() for p in (tmp_path / hosts[0].name / "logs").glob("worker-*.w1.log"))
    assert "waits as a spare" in spare_log
    assert "resumed from" not in text and "every copy of a shard" not in text  # nothing from disk before 5

    # 5: everything is gone; one host of 4 workers resumes from the newest durable checkpoint
    # on groups of 3: one group, and a spare that waits through to the end.
    again = start(tmp_path, ["--rdzv-endpoint", hosts.etcd_endpoint, "--job-id", f"{job_id}-again",
                             "--host-addr", "127.0.0.1", "--nproc-per-node", "4", "--min-np", "4",
                             "--collective-timeout", "20", "--checkpoint-dir", str(checkpoints),
                             "--checkpoint-take-over"],
                  ["--steps", str(STEPS), "--min-groups", "1", "--shard-size", "3"], name="again")
    try:
        assert again.wait(200) == 0, again.text()[-4000:]
    finally:
        if again.proc.poll() is None:
            again.kill()
    resumed = again.text()
    assert re.search(r"resumed from durable checkpoint step \d+ \(world \d -> 1x3 groups \[\[0, 1, 2\]\], "
                     r"spares \[3\]\)", resumed), resumed[-3000:]
    assert "[rank3]: elastic: round 1: training finished while this worker was a spare" in resumed, resumed[-3000:]
    assert_equals_reference(tmp_path, STEPS)
