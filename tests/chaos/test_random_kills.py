"""Chaos: kill random workers again and again while the agent replaces them.

Slow (about a minute): excluded from the default run, run by CI with `-m slow`.
"""

from __future__ import annotations

import os
import random
import signal

import pytest
import torch

from tests.fakes.jobs import Job, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

KILLS = 5
STEPS = 500


def test_repeated_random_sigkills_with_replacements_finish_consistently(tmp_path):
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    job = Job(tmp_path, Job.train_args(
        tmp_path / "out", tmp_path / "logs",
        ["--np", "4", "--min-np", "2", "--max-restarts", str(KILLS), "--collective-timeout", "20"],
        # Held below 4 workers (committing in lockstep without training), the survivors cannot
        # finish before the last replacements, slow to start under load, have joined.
        ["--steps", str(STEPS), "--step-delay", "0.02", "--hold-below-world", "4"]))
    killed = []
    for _ in range(KILLS):
        reached = max((s["step"] for s in job.steps()), default=0)
        job.wait_for_step(reached + rng.randint(10, 40), timeout=120)
        entries = job.pids()
        newest = max(e["round"] for e in entries)
        live = [e["pid"] for e in entries if e["round"] == newest and e["pid"] not in killed]
        victim = rng.choice(live)
        killed.append(victim)
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass
        # The next kill only after the ring has re-formed and made progress again.
        wait_until(lambda: any(e["round"] > newest for e in job.pids()), 120, "the next round")
    assert job.wait(300) == 0, job.text()[-3000:]

    finals = [torch.load(p, weights_only=True) for p in sorted((tmp_path / "out").glob("final-*.pt"))]
    assert len(finals) == 4  # every killed worker was replaced
    for other in finals[1:]:
        for name, value in finals[0].items():
            assert torch.equal(value, other[name]), name
    steps = [s["step"] for s in job.steps() if s["rank"] == 0]
    assert max(steps) == STEPS
    # Commit every step: each failure re-runs at most one step.
    assert len(steps) - len(set(steps)) <= KILLS
    failures = [e for e in job.events() if e["event"] == "reform_done" and e["failed"]]
    assert failures, "the survivors re-formed after the kills"
