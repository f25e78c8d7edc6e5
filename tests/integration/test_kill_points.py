"""A worker killed at any point of a step: the ring goes on from its newest commit.

Real etcd, a real elastic-run agent with three workers, real gloo, DDP without its
initial broadcast (so a worker that went on from another commit than its peers
would train on different parameters, and nothing would hide it). Rank 1 SIGKILLs
itself at a different point of five steps, including between rank 0's commit of a
step and its own; the agent replaces it each time, and the replacement receives the
state striped from the survivors. At that kill rank 2 is held before its own commit
(--lag-rank), so one survivor holds the step's commit and the other one commit less:
the laggard must receive the newest commit, never drag the ring back to its own. The job's final parameters, on every worker, must
equal a plain run's (a world of one) for the same number of steps: any worker that
had gone on from an older commit, or a torn one, would leave a difference.
"""

from __future__ import annotations

import uuid

import pytest

from tests.fakes.jobs import Job, read_jsonl
from tests.integration.test_global_batch_run import DATASET, check_same_as_a_plain_run

pytestmark = pytest.mark.timeout(900)

KILLS = "3:before-step,6:mid-step,9:before-commit,12:after-peer-commit,15:after-commit"
STEPS = 20
SCRIPT = ["--epochs", "1000", "--dataset-size", str(DATASET), "--global-batch-size", "100", "--float64",
          "--max-steps", str(STEPS)]


@pytest.mark.slow  # five failures, five replacements and a plain run: ~1-2 minutes on a loaded machine
def test_kills_at_every_point_of_a_step_leave_the_plain_trajectory(tmp_path, etcd_server):
    launcher = ["--rdzv-endpoint", etcd_server.endpoint, "--job-id", f"kills-{uuid.uuid4().hex[:8]}",
                "--nproc-per-node", "3", "--min-np", "1", "--max-np", "3", "--max-restarts", "10"]
    # --hold-below-world: each replacement joins before training goes on (the last world is 3).
    script = [*SCRIPT, "--kill-at", KILLS, "--kill-rank", "1", "--lag-rank", "2", "--hold-below-world", "3"]
    job = Job(tmp_path, Job.train_args(tmp_path / "out", tmp_path / "logs", launcher, script))
    try:
        assert job.wait(720) == 0, job.text()[-3000:]
    finally:
        job.kill()
    killed = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "out").glob("killed-*"))
    assert killed == [3, 6, 9, 12, 15], killed
    failures = [e for e in read_jsonl(tmp_path / "logs" / "events.jsonl")
                if e["event"] == "reform_done" and e["failed"]]
    assert len({e["round"] for e in failures}) >= 5, "every kill re-formed the ring"
    # The laggard of step 12: its re-formation after the kill received the commit, and
    # every survivor of that round went on from the same (the newest) commit.
    out = tmp_path / "out"
    laggard = int((out / "lagged-12").read_text())
    killed_at = (out / "killed-12").stat().st_mtime
    after = [e for e in failures if e["pid"] == laggard and e["time"] >= killed_at]
    assert after, f"no re-formation of the laggard {laggard} after the kill"
    lagged = after[0]
    assert lagged["received"] and lagged["sync_receivers"] >= 1 and lagged["sync_holders"] >= 1, lagged
    holders = [e for e in failures if e["round"] == lagged["round"] and e["pid"] != laggard]
    assert holders and not any(e["received"] for e in holders), holders
    assert {e["commit"] for e in holders} == {lagged["commit"]}, (lagged, holders)
    # On the console a failure is one line per surviving worker, its reform_done, even
    # when the sync moved a commit (the sync's own line is for the log file then); a
    # replacement that joined the round says what it received, in one line.
    console = [line.split("]: ", 1)[1] for line in job.text().splitlines() if line.startswith("[")]
    for round_number in sorted({e["round"] for e in failures}):
        survivors = [e for e in failures if e["round"] == round_number]
        lines = [line for line in console if f": round {round_number}: " in line]
        reforms = [line for line in lines if " reform_done " in line]
        others = [line for line in lines if " reform_done " not in line]
        assert len(reforms) == len(survivors), (round_number, lines)
        assert len(others) == survivors[0]["world_size"] - len(survivors), (round_number, lines)
        assert all("sync of commit" in line and ": received " in line for line in others), (round_number, lines)
    last_world = max(read_jsonl(tmp_path / "out" / "pids.jsonl"), key=lambda e: e["round"])["world"]
    check_same_as_a_plain_run(tmp_path, SCRIPT, last_world)  # the plain run: no kills, no waiting for a world of 3
