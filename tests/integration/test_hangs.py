"""Hung workers under real elastic-run agents, real etcd and real gloo rings.

A frozen worker (SIGSTOP; on two namespaced hosts with their own addresses,
tests/fakes/netns.py) and a main thread sleeping forever outside any
collective are detected by their own agent, which asks for their stacks, kills
them, and reports them lost; the survivors re-form and finish. An honest slow
step is never taken for a hang.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
import torch

from elastic.contract.progress import HEARTBEAT_INTERVAL
from tests.fakes.jobs import Job, read_jsonl, wait_until

pytestmark = pytest.mark.timeout(300)

# The targets, with default options: 2 s from a SIGSTOP to the survivors' next step
# (issue 41), 10 s for a main thread stuck in user code (5 s floor: an idle main thread
# may be a healthy slow step). The machine is shared, so the tests allow a generous
# margin and print the figure they measured; benchmarks/faults.py measures it idle.
FROZEN_TARGET_S = 2.0
TARGET_S = 10.0
MARGIN_S = 15.0


def agent(tmp_path, endpoint, job_id, nproc, script_args, *, name, extra=(), host=None, env=None):
    """One elastic-run, inside ``host`` (a namespaced host) if given; default options else."""
    launcher = ["--rdzv-endpoint", endpoint, "--job-id", job_id, "--nproc-per-node", str(nproc), *extra]
    args = Job.train_args(tmp_path / "out", tmp_path / "logs", launcher, script_args)
    return host.job(tmp_path, args, name=name) if host is not None else Job(tmp_path, args, name=name, env=env)


def events(job, kind):
    return [e for e in job.events() if e["event"] == kind]


def final_params(out):
    finals = sorted(out.glob("final-*.pt"))
    return [torch.load(p, weights_only=True) for p in finals]


def assert_identical(params):
    assert len(params) >= 2
    for other in params[1:]:
        for key in params[0]:
            assert torch.equal(params[0][key], other[key]), key


def test_a_frozen_worker_is_killed_and_the_survivors_go_on(tmp_path, netns_hosts):
    hosts = netns_hosts(2)
    job_id = f"frozen-{uuid.uuid4().hex[:8]}"
    limits = ["--min-np", "2", "--max-np", "4"]
    # 130 steps after the freeze at step 20: time enough to stop the victim before the job
    # ends (>= 6.5 s of step delays), and steps of the survivors to assert on.
    args = ["--steps", "150", "--step-delay", "0.05", "--float64"]
    first = agent(tmp_path, hosts.etcd_endpoint, job_id, 2, args, name="first", extra=limits, host=hosts[0])
    second = agent(tmp_path, hosts.etcd_endpoint, job_id, 2, args, name="second", extra=limits, host=hosts[1])
    try:
        # Past a few commits, so the watchdog has seen the step intervals.
        wait_until(lambda: any(s["step"] >= 20 and s["world"] == 4 for s in first.steps()), 120, "step 20 of 4")
        victim = first.worker_pid(3)
        os.kill(victim, signal.SIGSTOP)
        frozen_at = time.time()
        wait_until(lambda: any(s["world"] == 3 for s in first.steps()), FROZEN_TARGET_S + MARGIN_S,
                   "a step of the 3 survivors")
        resumed = min(s["t"] for s in first.steps() if s["world"] == 3)
        assert first.wait(180) == 0, first.text()[-3000:]
        assert second.wait(60) == 0, second.text()[-3000:]
    finally:
        for job in (first, second):
            job.kill()
    took = resumed - frozen_at
    hangs = events(first, "hang_detected")
    assert len(hangs) == 1, hangs
    hang = hangs[0]
    print(f"\nfrozen worker: declared hung after {hang['time'] - frozen_at:.2f}s, "
          f"survivors' next step {took:.2f}s after SIGSTOP")
    assert took <= FROZEN_TARGET_S + MARGIN_S
    full_round = max(e["round"] for e in events(first, "round_formed") if e["world_size"] == 4)
    assert hang["kind"] == "frozen" and hang["rank"] == 3 and hang["round"] == full_round
    # A stopped worker is judged on its silent heartbeat with the stopped bound: 1 s, or 3x
    # its slowest step if a loaded machine made one longer than a third of that, never the
    # 5 s floor of a healthy-looking state; its last commit may have come up to one
    # heartbeat interval after its last beat.
    assert 1.0 <= hang["timeout_s"] < 5.0 and hang["stalled_s"] >= hang["timeout_s"] - HEARTBEAT_INTERVAL
    exited = [e for e in first.events() if e["event"] == "worker_exited" and e["worker"] == hang["worker"]]
    assert exited and exited[0]["signal"] == signal.SIGKILL, "its own agent SIGKILLed the stopped worker"
    # Asked for its stacks; a stopped process cannot answer, and the line says so.
    console = first.text() + second.text()
    assert f"worker {hang['worker']} (rank 3, round {full_round}) hung (frozen): no progress for" in console
    assert "no stacks (a stopped process cannot answer); killed" in console
    # Nobody else was taken for hung: the victims blocked in the ring survived.
    sizes = [e["world_size"] for e in events(first, "round_formed")]
    assert sizes[-2:] == [4, 3] and sizes.count(3) == 1, sizes
    params = final_params(tmp_path / "out")
    assert len(params) == 3
    assert_identical(params)


@pytest.mark.slow  # the frozen-worker test runs by default; this one in the slow run (CI)
def test_a_main_thread_sleeping_outside_any_collective_is_killed_with_its_stack_logged(tmp_path):
    # Held below 3 workers (committing in lockstep without training), the survivors cannot
    # finish before the replacement, slow to start under load, has joined.
    args = ["--steps", "200", "--step-delay", "0.05", "--hang-rank", "1", "--hang-step", "30",
            "--hold-below-world", "3"]
    launcher = ["--np", "3", "--min-np", "2", "--max-restarts", "1"]
    job = Job(tmp_path, Job.train_args(tmp_path / "out", tmp_path / "logs", launcher, args))
    try:
        hung = wait_until(lambda: read_jsonl(tmp_path / "out" / "hung.jsonl"), 120, "the main thread to hang")[0]
        assert job.wait(240) == 0, job.text()[-3000:]
    finally:
        job.kill()
    hangs = events(job, "hang_detected")
    assert len(hangs) == 1, hangs
    hang = hangs[0]
    assert hang["kind"] == "stuck" and hang["rank"] == 1
    assert "train_job.py" in hang["where"] and "sleep_forever" in hang["where"]
    detected = hang["time"] - hung["time"]
    print(f"\nstuck main thread: declared hung {detected:.2f}s after it started sleeping")
    assert 5.0 <= detected <= TARGET_S + MARGIN_S
    # Its stacks, every thread's, are in its log, with the frame it sleeps in.
    log = (tmp_path / "logs" / f"worker-{hang['worker']}.log").read_text()
    dump = log[log.index("declared hung"):]
    assert "sleep_forever" in dump
    assert dump.count("most recent call first") >= 2, "every thread's stack, not only the main one"
    assert hang["stacks"] == str(tmp_path / "logs" / f"worker-{hang['worker']}.log")
    assert f"stacks in {hang['stacks']}; killed" in job.text()
    # Replaced (--max-restarts 1): the survivors re-form at once without it, and the new
    # worker joins in the round after (it has to start first).
    started = [e for e in events(job, "worker_started") if e["time"] > hang["time"]]
    assert len(started) == 1 and started[0]["worker"] != hang["worker"]
    assert [e["world_size"] for e in events(job, "round_formed")] == [3, 2, 3]
    assert max(s["step"] for s in job.steps()) == 200
    params = final_params(tmp_path / "out")
    assert len(params) == 3
    assert_identical(params)


@pytest.mark.slow
def test_honest_12_second_steps_are_never_taken_for_a_hang(tmp_path):
    """Each step sleeps in user code (idle, as a stuck main thread looks) for more than
    twice the 5 s floor: the first two under the patient bound before any interval was
    seen, the third under 3 x the slowest interval (36 s)."""
    args = ["--steps", "3", "--step-delay", "12"]
    job = Job(tmp_path, Job.train_args(tmp_path / "out", tmp_path / "logs", ["--np", "2"], args))
    try:
        assert job.wait(240) == 0, job.text()[-3000:]
    finally:
        job.kill()
    assert events(job, "hang_detected") == []
    assert [e["world_size"] for e in events(job, "round_formed")] == [2]
    assert max(s["step"] for s in job.steps()) == 3


@pytest.mark.slow  # 60 s
def test_a_joiner_whose_set_up_keeps_the_gil_shows_its_stacks_at_once_and_joins_when_it_wakes(tmp_path, etcd_server):
    """A library deadlocked in C code while holding the GIL silences every thread of the
    worker, its heartbeat too, while all of them sleep. That is judged with the patient
    bound before any step was seen (CUDA's initialisation looks alike), but its agent
    shows the stacks within the freeze bound, without killing it. The running ring
    trains on meanwhile; when the set-up ends, the joiner joins."""
    job_id = f"gil-{uuid.uuid4().hex[:8]}"
    limits = ["--min-np", "2", "--max-np", "3"]
    args = ["--steps", "700", "--step-delay", "0.05"]
    first = agent(tmp_path, etcd_server.endpoint, job_id, 2, args, name="first", extra=limits)
    second = None
    try:
        wait_until(lambda: any(s["world"] == 2 for s in first.steps()), 120, "steps of the first 2 workers")
        second = agent(tmp_path, etcd_server.endpoint, job_id, 1, args, name="second", extra=limits,
                       env={"TRAIN_JOB_SETUP_HOLDS_GIL": "20"})
        held = wait_until(lambda: read_jsonl(tmp_path / "out" / "gil.jsonl"), 60, "the joiner to keep the GIL")[0]
        suspected = wait_until(lambda: events(second, "hang_suspected"), 20, "the joiner's stacks")[0]
        before_wake = [s for s in first.steps() if s["t"] < held["time"] + held["seconds"] - 1]
        wait_until(lambda: any(s["world"] == 3 for s in first.steps()), 60, "a step with the joiner")
        assert first.wait(180) == 0, first.text()[-3000:]
        assert second.wait(60) == 0, second.text()[-3000:]
    finally:
        for job in (first, second):
            if job is not None:
                job.kill()
    shown = suspected["time"] - held["time"]
    print(f"\njoiner keeping the GIL: stacks shown {shown:.2f}s after it began")
    assert 5.0 <= shown <= TARGET_S + MARGIN_S
    assert suspected["stacks"] == str(tmp_path / "logs" / f"worker-{suspected['worker']}.log")
    log = (tmp_path / "logs" / f"worker-{suspected['worker']}.log").read_text()
    dump = log[log.index("heartbeat silent"):]
    assert "sleep_holding_the_gil" in dump
    assert f"stacks in {suspected['stacks']}; declared hung if it lasts 300s" in second.text()
    assert not events(second, "hang_detected") and not events(first, "hang_detected")
    # The ring never waited for it: steps went on at world 2 while it slept.
    assert max(s["step"] for s in before_wake) > min(s["step"] for s in before_wake) + 20
    assert max(s["step"] for s in first.steps()) == 700
