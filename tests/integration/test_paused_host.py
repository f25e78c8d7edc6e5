"""A whole host paused (a VM paused, or SIGSTOP of its agent and workers together)
for longer than --rdzv-ttl, then resumed. Three agents share one etcd, one worker
each, all on loopback.

While it is paused nothing on it answers, but nothing refuses either (the kernel
still completes TCP handshakes for its listening sockets): its lease runs out, and
the survivors go on without it within about the TTL. When it resumes it must not
disturb anyone: its worker never completes a commit in the round the job has left,
and it comes back into the job (its agent registers again, its worker joins the
running ring at a commit); the job ends with every agent exiting 0 and equal
parameters.

The pause is taken at a known point: every worker waits, after the all-reduce of
step ``PAUSE_STEP`` and before committing it, for a file of its own host. The paused
host's file is created while it is stopped, so once resumed its worker goes straight
on to commit a step of the round the job left: the moment its view of the job (the
control watch, in another thread) may not have caught up yet.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
import torch

from tests.fakes.jobs import Job, wait_until

pytestmark = pytest.mark.timeout(300)

TTL = 5.0
SLACK_S = 6.0  # a loaded 2-core machine; the figure measured is printed
PAUSE_STEP = 30
HOSTS = ("a", "b", "c")


def three_hosts(tmp_path, etcd_server):
    """Three agents started together: the first round (a long settle window) has all three
    from step 0, so every worker reaches PAUSE_STEP in the same ring."""
    job_id = f"paused-{uuid.uuid4().hex[:10]}"
    common = ["--rdzv-endpoint", etcd_server.endpoint, "--job-id", job_id, "--host-addr", "127.0.0.1",
              "--nproc-per-node", "1", "--min-np", "2", "--max-np", "3", "--rdzv-ttl", str(TTL),
              "--rdzv-settle", "60", "--collective-timeout", "60"]
    out, logs = tmp_path / "out", tmp_path / "logs"
    jobs = {}
    for name in HOSTS:
        script = ["--steps", "100000", "--step-delay", "0.0", "--stop-file", str(tmp_path / "stop"), "--float64",
                  "--wait-step", str(PAUSE_STEP), "--wait-file", str(tmp_path / f"go-{name}")]
        jobs[name] = Job(tmp_path, Job.train_args(out, logs, [*common, "--host-id", f"host-{name}"], script),
                         name=name)
    return jobs


def worker_pids(job: Job, host: str) -> list[int]:
    """The host's live workers (they run in sessions of their own, apart from the agent's)."""
    return [e["pid"] for e in job.events() if e["event"] == "worker_started" and e["host"] == host
            and _alive(e["pid"])]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def host_of_rank0(job: Job) -> str:
    pid = next(p["pid"] for p in job.pids() if p["round"] == 1 and p["rank"] == 0)
    return next(e["host"] for e in job.events() if e["event"] == "worker_started" and e["pid"] == pid)


# rank 0's host also holds the round's store and leads: when it resumes, its coordinator
# must stand down and its store must not be waited on. A plain host is the same path.
# A plain host paused: the same assertions on a simpler path (nothing to hand over): by hand
# only (`make test-extended`); the default run has the host holding every role.
@pytest.mark.parametrize("victim", ["rank0-store-and-coordinator", pytest.param("plain", marks=pytest.mark.extended)])
def test_a_paused_host_is_left_behind_and_disturbs_nobody_when_it_resumes(tmp_path, etcd_server, victim):
    jobs = three_hosts(tmp_path, etcd_server)
    a = jobs["a"]
    try:
        at_pause = lambda: [s for s in a.steps() if s["step"] == PAUSE_STEP]  # noqa: E731
        wait_until(lambda: len(at_pause()) == 3, 180, f"every worker at step {PAUSE_STEP}")
        assert {s["world"] for s in at_pause()} == {3}, at_pause()
        rank0 = host_of_rank0(a)
        name = rank0[len("host-"):] if victim != "plain" else next(n for n in HOSTS if f"host-{n}" != rank0)
        paused = jobs[name]
        pids = [paused.proc.pid, *worker_pids(a, f"host-{name}")]
        woken = pids[1:]
        old_round = next(s["round"] for s in at_pause() if s["pid"] in woken)
        signal_all(pids, signal.SIGSTOP)
        paused_at = time.time()
        for other in HOSTS:  # the survivors commit the step and block in the next one
            (tmp_path / f"go-{other}").touch()

        def moved_on():
            return [s for s in a.steps() if s["t"] > paused_at and s["world"] == 2]

        steps = wait_until(moved_on, TTL + 2 + SLACK_S + 30, "a step of the 2 survivors")
        moved_at = min(s["t"] for s in steps)
        stall = moved_at - paused_at
        time.sleep(1.0)  # paused a while past the TTL, as a VM would be
        signal_all(pids, signal.SIGCONT)
        resumed_at = time.time()
        wait_until(lambda: len([s for s in a.steps() if s["world"] == 3 and s["t"] > resumed_at]) >= 30, 120,
                   "the ring to grow back to 3 after the resume")
        (tmp_path / "stop").touch()
        for job in jobs.values():
            assert job.wait(120) == 0, job.text()[-4000:]
    finally:
        for job in jobs.values():
            if job.proc.poll() is None:
                signal_all([job.proc.pid], signal.SIGCONT)
                job.kill()
    back = min(s["t"] for s in a.steps() if s["world"] == 3 and s["t"] > resumed_at) - resumed_at
    print(f"\n{victim}: survivors' next step {stall:.2f}s after the pause (ttl {TTL:g}s); "
          f"back to 3 workers {back:.2f}s after the resume")
    assert stall < TTL + 2 + SLACK_S, f"survivors waited {stall:.1f}s (ttl {TTL:g}s)"

    events = a.events()
    woken_ids = {e["worker"] for e in events if e["event"] == "worker_started" and e["pid"] in woken}
    # The woken worker completed no commit, and no step, of the round the job had left.
    late = [e for e in events if e["event"] == "steps" and e["worker"] in woken_ids
            and e["round"] == old_round and e["end"] > moved_at]
    assert not late, f"commits of round {old_round} after the job moved on: {late}"
    late = [s for s in a.steps() if s["pid"] in woken and s["round"] == old_round and s["t"] > moved_at]
    assert not late, f"steps of round {old_round} after the job moved on: {late}"
    # It came back: the same process is in the grown ring.
    assert any(p["pid"] in woken and p["world"] == 3 and p["round"] > old_round for p in a.pids()), a.pids()[-5:]
    # Nobody failed; the job succeeded; everyone ends with the same parameters.
    assert not [e for e in events if e.get("user_error")], [e for e in events if e.get("user_error")]
    finished = [e["status"] for e in events if e["event"] == "job_finished"]
    assert finished and set(finished) == {"succeeded"}, finished
    finals = [torch.load(p, weights_only=True) for p in sorted(a.out.glob("final-*.pt"))]
    assert len(finals) == 3, [p.name for p in a.out.glob("final-*.pt")]
    for other in finals[1:]:
        for key, value in finals[0].items():
            assert torch.equal(value, other[key]), key
