"""A Horovod elastic script (``import elastic.horovod as hvd``) on real gloo workers.

Real etcd, real elastic-run agents: tests/fakes/hvd_elastic_train.py (hvd.init,
hvd.DistributedOptimizer, hvd.elastic.TorchState / ElasticSampler / run, a reset
callback) is killed and joined, or joined between two commits, and must

* end equal (1e-9, float64) to the same computation replayed in this plain process
  from the steps the workers logged, each epoch's samples seen once;
* take a join at ``check_host_updates()`` with nothing rolled back;
* run its reset callbacks after the sync: a joiner's callback sees the ring's step
  and parameters, not its own initial ones (Horovod's issue 2844).
"""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.fakes.hvd_elastic_train import LR, MOMENTUM, data, new_model
from tests.fakes.jobs import REPO, Job, read_jsonl, wait_until

pytestmark = pytest.mark.timeout(300)

SCRIPT = REPO / "tests" / "fakes" / "hvd_elastic_train.py"


def agent(tmp_path: Path, endpoint: str, job_id: str, nproc: int, script_args: list[str], *, name: str) -> Job:
    """One elastic-run (horovodrun's spellings) with its own log dir; all write to tmp_path/out."""
    log_dir = tmp_path / f"logs-{name}"
    launcher = ["--rdzv-endpoint", endpoint, "--job-id", job_id, "--slots-per-host", str(nproc),
                "--min-num-proc", "2", "--max-num-proc", "3", "--output-filename", str(log_dir)]
    job = Job(tmp_path, [*launcher, "python", str(SCRIPT), "--out", str(tmp_path / "out"), *script_args], name=name)
    job.log_dir = log_dir
    return job


def worlds(job: Job) -> list[int]:
    return [e["world_size"] for e in job.events() if e["event"] == "round_formed"]


def trained_at(job: Job, world: int, steps: int) -> bool:
    """The newest round has ``world`` ranks and has run ``steps`` steps."""
    records = job.steps()
    if not records:
        return False
    newest = max(s["round"] for s in records)
    return len({s["step"] for s in records if s["round"] == newest and s["world"] == world}) >= steps


def kill_rank(job: Job, rank: int) -> None:
    entries = job.pids()
    newest = max(e["round"] for e in entries)
    os.kill(next(e["pid"] for e in entries if e["round"] == newest and e["rank"] == rank), signal.SIGKILL)


def committed_steps(out: Path) -> dict[int, list[dict]]:
    """Per step, the records of the newest round that ran it (a step re-run after a
    rollback supersedes its first attempt)."""
    records = read_jsonl(out / "steps.jsonl")
    newest: dict[int, int] = {}
    for s in records:
        newest[s["step"]] = max(newest.get(s["step"], 0), s["round"])
    by_step: dict[int, list[dict]] = {}
    for s in records:
        if s["round"] == newest[s["step"]]:
            by_step.setdefault(s["step"], []).append(s)
    assert sorted(by_step) == list(range(1, max(by_step) + 1))
    for step, ranks in by_step.items():
        assert sorted(r["rank"] for r in ranks) == list(range(ranks[0]["world"])), f"step {step}: {ranks}"
    return by_step


def replay(by_step: dict[int, list[dict]], dataset_size: int) -> dict[str, torch.Tensor]:
    """The same computation in this process: each step, the average over the ranks of the
    gradient of each rank's mean loss (what DistributedOptimizer's Average gives), then SGD."""
    x, y = data(dataset_size)
    model = new_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in sorted(by_step):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for record in by_step[step]:
            rows = torch.tensor(record["indices"])
            model.zero_grad()
            F.mse_loss(model(x[rows]), y[rows]).backward()
            for total, p in zip(grads, model.parameters()):
                total += p.grad
        for total, p in zip(grads, model.parameters()):
            p.grad = total / len(by_step[step])
        optimizer.step()
    return model.state_dict()


def check_against_the_plain_replay(out: Path, dataset_size: int, last_world: int) -> float:
    by_step = committed_steps(out)
    seen: dict[int, list[int]] = {}
    for ranks in by_step.values():
        for record in ranks:
            seen.setdefault(record["epoch"], []).extend(record["indices"])
    for epoch, indices in seen.items():
        if epoch != max(seen):  # a whole epoch: every sample, repeats only as Horovod's wrap-around padding
            assert set(indices) == set(range(dataset_size)), f"epoch {epoch} missed samples"
            assert len(indices) - dataset_size < 3, f"epoch {epoch} repeated samples"
    expected = replay(by_step, dataset_size)
    finals = [torch.load(p, weights_only=True) for p in sorted(out.glob("final-*.pt"))]
    assert len(finals) == last_world
    worst = 0.0
    for params in finals:
        for name, value in expected.items():
            assert params[name].dtype == torch.float64
            worst = max(worst, (params[name] - value).abs().max().item())
    assert worst <= 1e-9, f"max parameter difference {worst:g} from the plain replay"
    return worst


def check_callbacks_saw_the_synced_state(out: Path, round_number: int, world: int) -> dict:
    """Every worker of ``round_number`` (the joiner too) ran its callback once, all with the same step and
    parameters: the ring's, after the sync."""
    resets = [r for r in read_jsonl(out / "resets.jsonl") if r["round"] == round_number]
    assert sorted(r["rank"] for r in resets) == list(range(world)), resets
    assert len({(r["step"], r["epoch"], r["checksum"]) for r in resets}) == 1, resets
    assert resets[0]["step"] > 0
    return resets[0]


def stop_and_wait(stop: Path, *jobs) -> None:
    """Stop the training at one step (the scripts watch ``stop``); every agent exits 0."""
    stop.touch()
    for job in jobs:
        assert job.wait(60) == 0, job.text()[-3000:]


@pytest.mark.slow
def test_a_kill_and_a_join_end_equal_to_the_plain_computation(tmp_path, etcd_server):
    job_id = f"hvd-{uuid.uuid4().hex[:8]}"
    stop = tmp_path / "stop"
    script = ["--dataset-size", "240", "--stop-file", str(stop)]  # 20 steps per epoch at world 3
    first = agent(tmp_path, etcd_server.endpoint, job_id, 3, script, name="first")
    joiner = None
    try:
        wait_until(lambda: trained_at(first, 3, 5), 120, "5 steps of 3 workers")
        kill_rank(first, 0)  # the new rank 0 must hold the same commit
        wait_until(lambda: worlds(first) == [3, 2], 60, f"the world 3 -> 2 (saw {worlds(first)})")
        wait_until(lambda: trained_at(first, 2, 5), 60, "5 steps of 2 workers")
        joiner = agent(tmp_path, etcd_server.endpoint, job_id, 1, script, name="joiner")
        wait_until(lambda: worlds(first) == [3, 2, 3], 120, f"the world 2 -> 3 (saw {worlds(first)})")
        wait_until(lambda: trained_at(first, 3, 25), 120, "25 steps of 3 workers again (an epoch's end)")
        stop_and_wait(stop, first, joiner)
    finally:
        for job in (first, joiner):
            if job is not None:
                job.kill()
    worst = check_against_the_plain_replay(tmp_path / "out", 240, last_world=3)
    join_round = max(r["round"] for r in read_jsonl(tmp_path / "out" / "pids.jsonl"))
    check_callbacks_saw_the_synced_state(tmp_path / "out", join_round, 3)
    print(f"max |elastic - plain| parameter difference: {worst:.3g}")


@pytest.mark.slow  # about 50 s: make test stays under 15 min
def test_check_host_updates_takes_a_join_with_nothing_rolled_back(tmp_path, etcd_server):
    job_id = f"hvd-{uuid.uuid4().hex[:8]}"
    stop = tmp_path / "stop"
    # One commit in 1000 steps and no epoch's end in sight: only check_host_updates() can take the join.
    script = ["--dataset-size", "8000", "--commit-every", "1000", "--stop-file", str(stop)]
    first = agent(tmp_path, etcd_server.endpoint, job_id, 2, script, name="first")
    joiner = None
    try:
        wait_until(lambda: trained_at(first, 2, 3), 120, "3 steps of 2 workers")
        joiner = agent(tmp_path, etcd_server.endpoint, job_id, 1, script, name="joiner")
        wait_until(lambda: trained_at(first, 3, 3), 120, f"3 steps of 3 workers (worlds {worlds(first)})")
        stop_and_wait(stop, first, joiner)
    finally:
        for job in (first, joiner):
            if job is not None:
                job.kill()
    out = tmp_path / "out"
    assert worlds(first) == [2, 3]
    checks = read_jsonl(out / "checks.jsonl")
    assert sorted(c["rank"] for c in checks) == [0, 1] and len({c["step"] for c in checks}) == 1, checks
    switched_at = checks[0]["step"]
    assert switched_at % 1000 != 0  # between two commits
    records = read_jsonl(out / "steps.jsonl")
    old_round, new_round = checks[0]["round"], max(r["round"] for r in records)
    assert max(r["step"] for r in records if r["round"] == old_round) == switched_at
    assert min(r["step"] for r in records if r["round"] == new_round) == switched_at + 1  # nothing re-run
    seen = callback = check_callbacks_saw_the_synced_state(out, new_round, 3)
    assert callback["step"] == switched_at, seen
    check_against_the_plain_replay(out, 8000, last_world=3)
