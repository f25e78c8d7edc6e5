"""Token shards end to end: every sample once per epoch through kills, a join, a host's loss,
a total loss and a resume at another world size, and the plain run's final weights.

Real etcd, real elastic-run agents (one per host id, on loopback), real gloo: a small
GPT-style model in float64 reads 64 shards of uint16 tokens written by the test through
``ShardedSource`` + ``SourceSampler`` + ``DataLoader(num_workers=2, prefetch_factor=4,
persistent_workers=True)``, a constant global batch of 32. One job sees, in order: world 2
(host a), a join (host b: world 3), a SIGKILLed worker (replaced by its agent), the loss of
host b (its agent SIGKILLed; its worker dies with it), then the loss of everything; a second
job resumes from the durable checkpoint with 3 workers, not 2, and finishes the two epochs.

The host's loss is local: the agent and its workers SIGKILLed together, as
tests/integration/test_host_loss.py does (a lost VM, an OOM-killed pod). For the data
path that is what any loss of a host is: its workers' shares of the step in flight are
gone, the survivors roll back to the commit and the next ring reads the same global batch
again; how the host went (power, a cut link: tests/hosts/) changes only how the loss is
detected, which the host and partition tests cover.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

import numpy as np
import pytest
import torch

from elastic.checkpoint import load_latest
from tests.fakes.jobs import REPO, Job, read_jsonl, wait_until

pytestmark = pytest.mark.timeout(600)

TOKEN_JOB = REPO / "tests" / "fakes" / "token_job.py"
SHARDS, PER_SHARD, SEQ = 64, 12, 16
SAMPLES = SHARDS * PER_SHARD  # 768: 24 global batches of 32 per epoch
EPOCHS = 2


def write_shards(folder) -> str:
    folder.mkdir()
    rng = np.random.default_rng(0)
    for k in range(SHARDS):
        rng.integers(0, 64, size=PER_SHARD * (SEQ + 1), dtype=np.uint16).tofile(folder / f"shard-{k:03d}.bin")
    return str(folder)


def agent(home, endpoint, job_id, host, nproc, script, launcher=()):
    home.mkdir(exist_ok=True)
    args = ["--rdzv-endpoint", endpoint, "--job-id", job_id, "--host-id", host, "--host-addr", "127.0.0.1",
            "--nproc-per-node", str(nproc), "--min-np", "1", "--max-np", "4", *launcher,
            "--log-dir", str(home / f"logs-{host}"), str(TOKEN_JOB), *script]
    job = Job(home, args, name=host)
    job.log_dir = home / f"logs-{host}"
    return job


def entered(out, world: int, new_pid: bool = False) -> bool:
    """Every worker of a ring of ``world`` entered train() (with ``new_pid``: one of them
    entering for the first time): a joiner or a replacement has switched in."""
    entries = read_jsonl(out / "pids.jsonl")
    if not entries:
        return False
    newest = max(e["round"] for e in entries if e["phase"] == 1)
    ring = [e for e in entries if e["phase"] == 1 and e["round"] == newest]
    firsts = {e["pid"] for e in ring} - {e["pid"] for e in entries if e["round"] < newest}
    return len(ring) == world and all(e["world"] == world for e in ring) and (bool(firsts) or not new_pid)


def trained_in_newest_round(out, phase: int, world: int, steps: int) -> bool:
    records = [s for s in read_jsonl(out / "steps.jsonl") if s["phase"] == phase]
    if not records:
        return False
    newest = max(s["round"] for s in records)
    done = {s["step"] for s in records if s["round"] == newest and s["world"] == world}
    return len(done) >= steps


def plain_run(tmp_path, script) -> tuple[dict, list[dict]]:
    out = tmp_path / "plain"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, str(TOKEN_JOB), *script, "--out", str(out)], env=env, check=True,
                   timeout=300, capture_output=True)
    (final,) = out.glob("final-*.pt")
    return torch.load(final, weights_only=True), read_jsonl(out / "steps.jsonl")


def global_batches(records) -> tuple[dict[int, list[int]], dict[int, int]]:
    """Per step, the ids its newest (phase, round) trained (a step re-run after a rollback or a
    resume supersedes its earlier runs), and the step's epoch."""
    newest: dict[int, tuple] = {}
    for s in records:
        newest[s["step"]] = max(newest.get(s["step"], (0, 0)), (s["phase"], s["round"]))
    batches: dict[int, list[int]] = {}
    epochs: dict[int, int] = {}
    for s in records:
        if (s["phase"], s["round"]) == newest[s["step"]]:
            batches.setdefault(s["step"], []).extend(s["ids"])
            epochs[s["step"]] = s["epoch"]
    return batches, epochs


@pytest.mark.slow  # ~2 min wall on an idle 2-core machine: 7 worker starts, 4 agents and a plain run
def test_every_token_sample_once_per_epoch_through_every_kind_of_loss(tmp_path, etcd_server):
    data = write_shards(tmp_path / "data")
    out, hold, ckpt = tmp_path / "out", tmp_path / "hold", tmp_path / "ckpt"
    script = ["--data", data, "--seq-len", str(SEQ), "--epochs", str(EPOCHS), "--global-batch-size", "32",
              "--num-workers", "2"]
    elastic_script = [*script, "--out", str(out), "--hold-file", str(hold), "--step-delay", "0.1"]
    durable = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"]
    first_job = f"tokens-{uuid.uuid4().hex[:8]}"
    a = agent(tmp_path / "a", etcd_server.endpoint, first_job, "host-a", 2, [*elastic_script, "--phase", "1"],
              ["--max-restarts", "1", *durable])
    agents = [a]
    try:
        wait_until(lambda: trained_in_newest_round(out, 1, 2, 3), 180, "3 steps at world 2")
        # A join: the ring holds (commits, no training) until host b's worker switches in.
        hold.touch()
        b = agent(tmp_path / "b", etcd_server.endpoint, first_job, "host-b", 1, [*elastic_script, "--phase", "1"],
                  durable)
        agents.append(b)
        wait_until(lambda: entered(out, 3, new_pid=True), 180, "host b's worker to switch in")
        hold.unlink()
        wait_until(lambda: trained_in_newest_round(out, 1, 3, 3), 120, "3 steps at world 3")
        # A kill: a worker of host a, replaced by its agent; the ring holds until the replacement is in.
        hold.touch()
        victim = next(e["pid"] for e in reversed(read_jsonl(out / "pids.jsonl"))
                      if e["pid"] in {w["pid"] for w in a.events() if w["event"] == "worker_started"})
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: entered(out, 2), 120, "the survivors' ring of 2")
        wait_until(lambda: entered(out, 3, new_pid=True), 180, "host a's replacement to switch in")
        hold.unlink()
        wait_until(lambda: trained_in_newest_round(out, 1, 3, 3), 120, "3 steps after the kill")
        # A host's loss: host b's agent SIGKILLed, its worker dies with it.
        os.kill(b.proc.pid, signal.SIGKILL)
        wait_until(lambda: trained_in_newest_round(out, 1, 2, 3), 120, "3 steps at world 2 after host b's loss")
        # The loss of everything, mid-epoch, once the newest step is durable.
        hold.touch()
        newest_step = lambda: max(s["step"] for s in read_jsonl(out / "steps.jsonl"))  # noqa: E731
        wait_until(lambda: (found := load_latest(str(ckpt))) and found[0]["values"]["step"] == newest_step(), 60,
                   "the newest step on disk")
        lost_at = newest_step()
        assert 0 < lost_at < EPOCHS * SAMPLES // 32, "the loss must come before the end"
        a.kill()
        hold.unlink()
        # Resumed by another job, at another world size (3, not 2), to the end.
        c = agent(tmp_path / "c", etcd_server.endpoint, f"tokens-{uuid.uuid4().hex[:8]}", "host-c", 3,
                  [*elastic_script, "--phase", "2"], [*durable, "--checkpoint-take-over"])
        agents.append(c)
        assert c.wait(300) == 0, c.text()[-3000:]
        assert "resumed from durable checkpoint" in c.text()
    finally:
        for job in agents:
            job.kill()

    records = read_jsonl(out / "steps.jsonl")
    assert {s["world"] for s in records if s["phase"] == 1} == {2, 3}
    assert {s["world"] for s in records if s["phase"] == 2} == {3}
    batches, epochs = global_batches(records)
    steps = EPOCHS * SAMPLES // 32
    assert sorted(batches) == list(range(1, steps + 1))
    seen: dict[int, list[int]] = {}
    for step, ids in batches.items():
        seen.setdefault(epochs[step], []).extend(ids)
    for epoch in range(EPOCHS):
        assert len(seen[epoch]) == SAMPLES and sorted(seen[epoch]) == list(range(SAMPLES)), f"epoch {epoch}"

    plain_final, plain_records = plain_run(tmp_path, script)
    for record in plain_records:  # the same global batch at every step, whatever the world
        assert sorted(batches[record["step"]]) == sorted(record["ids"]), f"step {record['step']}"
    finals = [torch.load(p, weights_only=True) for p in sorted(out.glob("final-*.pt"))]
    assert len(finals) == 3
    worst = max((f[name] - value).abs().max().item() for f in finals for name, value in plain_final.items())
    assert worst <= 1e-9, f"max parameter difference {worst:g} from the plain run"

    # The loader's workers: a process that went through a re-formation kept them.
    loader = read_jsonl(out / "loader.jsonl")
    by_pid: dict[int, list] = {}
    for entry in loader:
        by_pid.setdefault(entry["pid"], []).append(entry)
    survivors = [entries for entries in by_pid.values() if len(entries) > 1]
    assert survivors, "no process went through a re-formation"
    for entries in survivors:
        assert len({tuple(e["workers"]) for e in entries}) == 1, f"loader workers restarted: {entries}"
    first_batch = sorted(e["first_batch_s"] for entries in survivors for e in entries[1:])
    print(f"\nmax |elastic - plain| = {worst:.3g}; time to the first batch after a re-formation: "
          f"median {first_batch[len(first_batch) // 2]:.3f} s, max {first_batch[-1]:.3f} s "
          f"({len(first_batch)} re-entries); the total loss at step {lost_at}")
