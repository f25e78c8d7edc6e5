"""A collective before ``@elastic.run`` ("rank 0 downloads, then ``dist.barrier()``"), end to end:
real etcd, a real agent, real gloo workers. In the job's first round every worker runs it
together and it works; the replacement of a killed worker runs it alone (the survivors
never run that code again), has no ring for it, and the job fails at once with one line
that says to move it into the decorated function (elastic/worker/pre_train.py says why it
cannot be made to work). The same barrier inside the function works on a replacement:
``test_fault_fates.py``'s replacement test runs it (``--setup-barrier inside``).
"""

from __future__ import annotations

import os
import pytest

from elastic.contract.exit_codes import USER_ERROR
from tests.fakes.jobs import Job, read_jsonl

pytestmark = pytest.mark.timeout(300)


def test_a_barrier_before_run_works_at_the_start_and_fails_a_replacement_in_one_line(tmp_path):
    out = tmp_path / "out"
    launcher = ["--np", "2", "--max-restarts", "1", "--collective-timeout", "20"]
    script = ["--steps", "300", "--step-delay", "0.02", "--setup-barrier", "before",
              "--kill-at", "3:after-allreduce", "--kill-rank", "1"]
    job = Job(tmp_path, Job.train_args(out, tmp_path / "logs", launcher, script))
    try:
        code = job.wait(120)
    finally:
        job.kill()
    ended = os.path.getmtime(job.output)
    text = job.text()
    first_round = read_jsonl(out / "barrier.jsonl")
    assert sorted(r["round"] for r in first_round) == [1, 1], text[-3000:]  # both passed it together
    assert code == USER_ERROR, text[-3000:]
    failed = [line for line in text.splitlines() if line.startswith("elastic-run: job ") and " failed: " in line]
    assert len(failed) == 1, text[-3000:]
    assert ("NoRingBeforeRun: a collective before @elastic.run (train_job.py:" in failed[0]
            and "cannot run on a worker joining the job under way (round 2)" in failed[0]), failed
    assert "move it into the @elastic.run function" in failed[0], failed
    assert "Traceback" not in text, text[-3000:]  # the replacement's console says it in that line
    killed = os.path.getmtime(out / "killed-3")
    assert ended - killed < 60, (ended - killed, text[-3000:])  # promptly: no wait for a timeout
    assert not any(s["step"] > 3 for s in job.steps()), text[-3000:]  # nobody trained on without it
