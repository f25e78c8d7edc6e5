"""Checkpoint options and the `checkpoints` command, through the real `elastic-run`."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from elastic.checkpoint import CheckpointPolicy, DurableWriter, list_checkpoints
from elastic.checkpoint import manifest as mf
from tests.fakes.jobs import ELASTIC_RUN, REPO, Job

pytestmark = pytest.mark.timeout(300)


def valid_steps(directory) -> list[int]:
    return [c.step for c in list_checkpoints(str(directory)) if c.valid]


def test_checkpoint_interval_and_keep_through_elastic_run(tmp_path):
    ckpt = tmp_path / "ckpt"
    steps, delay, interval = 40, 0.1, 1.0  # the training alone lasts >= 4 s: >= 3 timed writes
    job = Job(tmp_path, Job.train_args(
        tmp_path / "out", tmp_path / "logs",
        ["--np", "2", "--checkpoint-dir", str(ckpt), "--checkpoint-interval", str(interval), "--checkpoint-keep", "2"],
        ["--steps", str(steps), "--step-delay", str(delay)]))
    seen: set[int] = set()
    while job.proc.poll() is None:  # watch the directory while the job runs
        seen.update(valid_steps(ckpt))
        try:
            job.proc.wait(0.05)
        except subprocess.TimeoutExpired:
            pass
    assert job.wait() == 0, job.text()[-3000:]
    kept = valid_steps(ckpt)
    # --checkpoint-keep 2: the final step and one timed write; older ones were pruned.
    assert len(kept) == 2 and kept[0] == steps, kept
    assert len(seen | set(kept)) >= 3, (seen, kept)
    # --checkpoint-interval alone (no --checkpoint-every, whose default of 100 commits
    # would write nothing before the end): every write but the final one came by time.
    timed = sorted((seen | set(kept)) - {steps})
    assert timed and all(0 < s < steps for s in timed)
    # Spaced by time, not by commits (a step is 0.1 s): consecutive timed writes at least
    # about an interval apart (their published times; each write takes milliseconds).
    times = [e["time"] for e in job.events() if e["event"] == "checkpoint_written" and e["step"] != steps]
    assert len(times) >= 2, times
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert min(gaps) >= 0.8 * interval, gaps


@pytest.fixture
def three_checkpoints(tmp_path):
    directory = tmp_path / "ckpt"
    with DurableWriter(CheckpointPolicy(str(directory), keep=5)) as writer:
        for step in (10, 20, 30):
            assert writer.submit({"w": torch.full((100,), float(step))}, step=step)
            assert writer.flush(30) and writer.last_error is None
    return directory


def checkpoints_command(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([*ELASTIC_RUN, "checkpoints", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def flip_a_byte(path) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_elastic_run_checkpoints_lists_and_verifies_with_a_corrupt_one(three_checkpoints):
    flip_a_byte(three_checkpoints / mf.step_dirname(20) / mf.STATE_NAME)
    result = checkpoints_command(str(three_checkpoints))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["STEP", "CREATED", "SIZE", "NAME", "STATUS"]
    rows = {line.split()[0]: line for line in lines[1:4]}
    assert list(rows) == ["30", "20", "10"]  # newest first
    assert rows["30"].endswith("valid") and rows["10"].endswith("valid")
    assert "INVALID" in rows["20"] and "sha256" in rows["20"]
    assert lines[4] == "2 of 3 checkpoints valid"


def test_elastic_run_checkpoints_exit_status(three_checkpoints, tmp_path):
    for step in (10, 20, 30):
        os.remove(three_checkpoints / mf.step_dirname(step) / mf.MANIFEST_NAME)
    none_valid = checkpoints_command(str(three_checkpoints))
    assert none_valid.returncode == 1 and "0 of 3 checkpoints valid" in none_valid.stdout

    missing = checkpoints_command(str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert missing.stderr.strip().count("\n") == 0 and "does not exist" in missing.stderr
