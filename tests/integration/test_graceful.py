"""SIGTERM to an agent: a graceful leave at a commit, or (forced) a failure the rest recovers from.

Two agents share the session's etcd: "stay" runs 2 workers and holds rank 0 (it
registers first), "leave" runs 1 worker. Each worker sleeps --step-delay between
finishing a step and committing it, so a signal lands in the middle of a step.
"""

from __future__ import annotations

import collections
import signal
import uuid

import pytest

from tests.fakes.jobs import Job, wait_until

pytestmark = pytest.mark.timeout(180)

MAX_STEPS = 100000  # the test ends training with --stop-file once it has seen what it needs
# Both agents run on this machine: --host-id tells them apart in the events.
HOSTS = {"stay": "host-stay", "leave": "host-leave"}


def two_agents(tmp_path, etcd_server, *, stay_args=(), leave_args=(), script_args=()):
    job_id = f"graceful-{uuid.uuid4().hex[:12]}"  # never reused: a finished job keeps its status
    common = ["--rdzv-endpoint", etcd_server.endpoint, "--job-id", job_id, "--host-addr", "127.0.0.1",
              "--min-np", "1", "--max-np", "3",
              "--collective-timeout", "10"]
    script = ["--steps", str(MAX_STEPS), "--step-delay", "0.05", "--stop-file", str(stop_file(tmp_path)),
              *script_args]
    out, logs = tmp_path / "out", tmp_path / "logs"
    stay = Job(tmp_path, Job.train_args(out, logs, [*common, "--nproc-per-node", "2", *stay_args], script),
               name="stay")
    # The second agent registers once the first ring runs, so rank 0 is on "stay".
    stay.wait_for_step(3)
    leave = Job(tmp_path, Job.train_args(out, logs, [*common, "--nproc-per-node", "1", *leave_args], script),
                name="leave")
    wait_until(lambda: any(s["world"] == 3 for s in stay.steps()), 60, "the 3-worker ring to train")
    return stay, leave


def stop_file(tmp_path):
    return tmp_path / "stop"


def stop_after_steps_at_world_2(tmp_path, stay):
    """Let the survivors train a few steps on their own, then end the job."""
    wait_until(lambda: sum(1 for s in stay.steps() if s["world"] == 2 and s["round"] > 1) >= 5, 60,
               "5 steps of the 2-worker ring")
    stop_file(tmp_path).touch()


def by_host(events, host_prefix):
    return [e for e in events if str(e.get("host", "")).startswith(host_prefix)]


def rank0_steps(job):
    return [s["step"] for s in job.steps() if s["rank"] == 0]


def leaver_worker_exits(events, leave_host):
    return [e for e in events if e["event"] == "worker_exited" and e["host"] == leave_host]


def test_sigterm_mid_step_is_a_graceful_leave_with_no_lost_step(tmp_path, etcd_server):
    stay, leave = two_agents(tmp_path, etcd_server, stay_args=["--host-id", HOSTS["stay"]],
                             leave_args=["--host-id", HOSTS["leave"]])
    at_signal = max(rank0_steps(stay))
    leave.proc.send_signal(signal.SIGTERM)
    assert leave.wait(60) == 0, leave.text()[-3000:]
    stop_after_steps_at_world_2(tmp_path, stay)
    assert stay.wait(120) == 0, stay.text()[-3000:]

    events = stay.events()
    names = collections.Counter(e["event"] for e in events)
    left = by_host(events, HOSTS["leave"])
    assert [e["event"] for e in left if e["event"] in ("graceful_leave", "member_left")] == \
        ["graceful_leave", "member_left"]
    assert next(e for e in left if e["event"] == "member_left")["graceful"] is True
    # The leaving worker finished its step, switched at a commit and exited 0 on its own.
    exits = leaver_worker_exits(events, HOSTS["leave"])
    assert [(e["exit_code"], e["signal"]) for e in exits] == [(0, None)], exits
    formed = [e for e in events if e["event"] == "round_formed"]
    assert [e["world_size"] for e in formed] == [2, 3, 2]
    assert formed[-1]["reason"].endswith("1 left"), formed[-1]
    reforms = by_host([e for e in events if e["event"] == "reform_done"], HOSTS["stay"])
    assert reforms and not any(e["failed"] for e in reforms)
    assert [e["world_size"] for e in reforms][-2:] == [2, 2]  # both survivors switched to the 2-ring
    # Nobody saw a failure: no worker declared lost, no ring broken, no rollback.
    assert names["failure_detected"] == 0, events
    assert not [e for e in formed if "lost" in e["reason"]], formed

    # Zero lost steps: every step ran exactly once on rank 0, through the leave.
    steps = rank0_steps(stay)
    assert sorted(steps) == list(range(1, max(steps) + 1))
    assert max(steps) > at_signal  # training went on after the signal
    # The leaver's last step is a committed one the survivors built on (not done again).
    leaver_last = max(s["step"] for s in stay.steps() if s["world"] == 3)
    assert steps.count(leaver_last) == 1 and leaver_last >= at_signal


@pytest.mark.slow  # about 25 s: CI runs it; make test stays under 15 min
def test_second_sigterm_kills_workers_and_the_rest_recovers(tmp_path, etcd_server):
    # Rank 2 (the leaving host's worker) stalls in its first step, so the second SIGTERM
    # surely lands before the ring reaches the commit where it would have switched.
    stay, leave = two_agents(
        tmp_path, etcd_server, stay_args=["--host-id", HOSTS["stay"]],
        leave_args=["--host-id", HOSTS["leave"], "--grace-period", "60"],
        script_args=["--slow-rank", "2", "--slow-step", "1", "--slow-delay", "60"],
    )
    wait_until(lambda: any(s["rank"] == 2 for s in stay.steps()), 60, "rank 2 to stall in a step")
    leave.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: any(e["event"] == "graceful_leave" for e in by_host(stay.events(), HOSTS["leave"])),
               20, "the graceful leave to begin")
    leave.proc.send_signal(signal.SIGTERM)
    assert leave.wait(60) == 0, leave.text()[-3000:]
    stop_after_steps_at_world_2(tmp_path, stay)
    assert stay.wait(120) == 0, stay.text()[-3000:]
    assert_failure_path(stay, "SIGTERM again")


@pytest.mark.slow  # about 35 s: CI runs it; make test stays under 15 min
def test_worker_stuck_past_the_grace_period_is_killed_and_the_rest_recovers(tmp_path, etcd_server):
    # Rank 2 (the leaving host's worker) stalls 60 s inside its first step; the grace period is 1 s.
    stay, leave = two_agents(
        tmp_path, etcd_server, stay_args=["--host-id", HOSTS["stay"]],
        leave_args=["--host-id", HOSTS["leave"], "--grace-period", "1"],
        script_args=["--slow-rank", "2", "--slow-step", "1", "--slow-delay", "60"],
    )
    wait_until(lambda: any(s["rank"] == 2 for s in stay.steps()), 60, "rank 2 to stall in a step")
    leave.proc.send_signal(signal.SIGTERM)
    assert leave.wait(60) == 0, leave.text()[-3000:]
    stop_after_steps_at_world_2(tmp_path, stay)
    assert stay.wait(120) == 0, stay.text()[-3000:]
    assert_failure_path(stay, "grace period of 1s over")


def assert_failure_path(stay, forced_reason):
    events = stay.events()
    left = by_host(events, HOSTS["leave"])
    forced = [e for e in left if e["event"] == "failure_detected"]
    assert forced and forced_reason in forced[0]["reason"], left
    assert next(e for e in left if e["event"] == "member_left")["graceful"] is False
    exits = leaver_worker_exits(events, HOSTS["leave"])
    assert [e["signal"] for e in exits] == [signal.SIGKILL], exits
    # Survivors: the ring broke under them, they rolled back and re-formed as two.
    reforms = by_host([e for e in events if e["event"] == "reform_done"], HOSTS["stay"])
    assert len(reforms) == 2 + 2 and all(e["world_size"] == 2 for e in reforms[-2:])
    assert all(e["failed"] for e in reforms[-2:]), reforms
    steps = rank0_steps(stay)
    assert set(steps) == set(range(1, max(steps) + 1))
    assert len(steps) - len(set(steps)) <= 1  # commit every step: at most one step done again


@pytest.mark.slow  # about 28 s: CI runs it; make test stays under 15 min
def test_sigterm_that_leaves_too_few_workers_stops_the_job_with_a_final_checkpoint(tmp_path):
    from elastic.checkpoint import list_checkpoints

    from tests.fakes.jobs import Job

    ckpt = tmp_path / "ckpt"
    job = Job(tmp_path, Job.train_args(
        tmp_path / "out", tmp_path / "logs",
        ["--np", "3", "--min-np", "2", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1000"],
        ["--steps", "100000", "--step-delay", "0.02"]))
    job.wait_for_step(20)
    job.proc.send_signal(signal.SIGTERM)  # this agent holds every worker: the job must stop
    assert job.wait(90) == 0, job.text()[-3000:]
    events = job.events()
    assert [(e["exit_code"], e["signal"]) for e in events if e["event"] == "worker_exited"] == [(0, None)] * 3
    assert any(e["event"] == "job_finished" and e["status"] == "stopping" for e in events)
    assert not any(e["event"] in ("failure_detected", "reform_done") for e in events)
    # Every worker stopped at the same commit, and that commit is on disk.
    steps = [s["step"] for s in job.steps()]
    last = max(steps)
    assert all(max(s["step"] for s in job.steps() if s["pid"] == pid) == last
               for pid in {s["pid"] for s in job.steps()})
    valid = [c for c in list_checkpoints(str(ckpt)) if c.valid]
    assert valid and valid[0].step == last
