"""ShardedState(scheduler=lambda opt: ...): the scheduler, rebuilt with the optimizer on
every ring, takes the commit's state: through a kill of rank 0 and a re-shard from 3 to
2 ranks, every step's learning rate and the final float64 parameters equal a plain
single-process run's (tests/fakes/sharded_job.py --scheduler: a StepLR)."""

from __future__ import annotations

import pytest

from tests.fakes.jobs import read_jsonl
from tests.fakes.sharded_runs import assert_equals_reference, reshards, start, worlds

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow  # about 70 s on the loaded 2-core machine: make test stays under 15 min
def test_the_learning_rate_follows_the_plain_run_through_a_kill_and_a_reshard(tmp_path):
    steps = 12
    job = start(tmp_path, ["--np", "3", "--min-np", "2", "--collective-timeout", "20"],
                ["--steps", str(steps), "--scheduler", "--kill-rank", "0", "--kill-step", "5"])
    assert job.wait(240) == 0, job.text()[-3000:]
    assert worlds(job) == [3, 2]
    # Step 5 was trained (its scheduler step taken) and never committed by rank 0: the
    # survivors re-sharded commit 4 and trained step 5 again.
    assert sum("re-sharded commit 4 (world 3 -> 2)" in line for line in reshards(job)) == 2, job.text()[-3000:]
    assert_equals_reference(tmp_path, steps, ["--scheduler"])
    expected = {r["step"]: r["lr"] for r in read_jsonl(tmp_path / "reference" / "reference.jsonl")}
    assert len(set(expected.values())) == 4  # StepLR halves it every 3 steps
    logged = read_jsonl(tmp_path / "out" / "steps.jsonl")
    assert sorted({r["step"] for r in logged}) == list(range(1, steps + 1))
    assert [r["step"] for r in logged if r["world"] == 2].count(5) == 2  # the repeated step, on both survivors
    for record in logged:
        assert record["lr"] == expected[record["step"]], record
