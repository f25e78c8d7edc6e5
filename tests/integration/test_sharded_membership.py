"""ShardedState through membership changes: kills, a join through a second agent, a graceful
leave, and init= (no rank builds the whole model). Real etcd (the session's server), real
gloo workers running FSDP2 in float64 (tests/fakes/sharded_job.py); the final parameters
must equal a plain single-process run within 1e-9 whatever the ring went through.

No run here passes --checkpoint-dir: every re-shard (onto a smaller ring, onto joiners,
after a leave) moves shards from the workers' memory."""

from __future__ import annotations

import collections
import re
import signal
import uuid

import pytest

from tests.fakes.jobs import Job, read_jsonl, wait_until
from tests.fakes.sharded_runs import assert_equals_reference, reshards, start, worlds

pytestmark = pytest.mark.timeout(300)

JOIN_LINE = re.compile(r"re-sharded commit (\d+) \(world (\d+) -> (\d+)\): received ([\d.]+) MB")


def common_args(etcd_server, *extra: str) -> list[str]:
    job_id = f"sharded-members-{uuid.uuid4().hex[:8]}"  # never reused: a finished job keeps its status
    return ["--rdzv-endpoint", etcd_server.endpoint, "--job-id", job_id, "--host-addr", "127.0.0.1",
            "--collective-timeout", "20", "--shard-replicas", "1", *extra]


def rank0_steps_by_ring(job: Job) -> list[tuple[int, list[int]]]:
    """(world, rank 0's steps in order) per ring, oldest first."""
    rings: dict[int, tuple[int, list[int]]] = {}
    for s in job.steps():
        if s["rank"] == 0:
            rings.setdefault(s["round"], (s["world"], []))[1].append(s["step"])
    return [rings[r] for r in sorted(rings)]


def transitions(*jobs: Job) -> list[tuple[int, int, int, float]]:
    """(commit, old world, new world, MB received) of every worker's re-shard line."""
    found = []
    for job in jobs:
        for line in reshards(job):
            match = JOIN_LINE.search(line)
            assert match, line
            found.append((int(match[1]), int(match[2]), int(match[3]), float(match[4])))
    return found


def wait_while_running(jobs, predicate, timeout: float, what: str) -> None:
    """Wait for ``predicate``; fail at once, with the job's output, if one of ``jobs`` ends first."""
    wait_until(lambda: predicate() or any(job.proc.poll() is not None for job in jobs), timeout, what)
    for job in jobs:
        assert job.proc.poll() is None, f"elastic-run ended before {what}:\n{job.text()[-3000:]}"


def kill_left_over(*jobs) -> None:
    """A failed test's agents go, with their workers (a job not started yet is None)."""
    for job in jobs:
        if job is not None and job.proc.poll() is None:
            job.kill()


def builds(tmp_path) -> list[dict]:
    return read_jsonl(tmp_path / "out" / "builds.jsonl")


def assert_nothing_read_from_disk(*jobs: Job) -> None:
    for job in jobs:
        text = job.text()
        assert "durable checkpoint" not in text and "resumed from" not in text, text[-3000:]


@pytest.mark.slow
def test_worlds_4_3_2_4_two_kills_then_a_joining_agent_all_from_memory_and_init_builds_nothing_whole(
        tmp_path, etcd_server):
    """Agent A runs 4 workers and replaces none (--max-restarts 0). Ring of 4: rank 2, a plain
    worker, dies after training step 3; ring of 3: rank 0 dies after step 6. The pair left
    trains steps 6-8, then commits without training until agent B's 2 workers have joined;
    the ring of 4 trains 9-12. The model is initialised by init= on every ring's shards:
    no rank ever builds it whole, joiners included."""
    steps = 12
    common = common_args(etcd_server, "--min-np", "2", "--max-np", "6", "--max-restarts", "0")
    script = ["--steps", str(steps), "--init", "--kill-at", "2:3", "--kill-at", "0:6",
              "--hold-from-step", "8", "--hold-until-world", "4"]
    a = start(tmp_path, [*common, "--host-id", "host-a", "--nproc-per-node", "4"], script, name="a")
    b = None
    try:
        # B starts once the pair has trained its steps: the join lands in the pair's hold.
        wait_while_running([a], lambda: any(s["world"] == 2 and s["step"] == 8 for s in a.steps()), 180,
                           "the pair's step 8")
        b = start(tmp_path, [*common, "--host-id", "host-b", "--nproc-per-node", "2"], script, name="b")
        assert a.wait(180) == 0, a.text()[-3000:]
        assert b.wait(60) == 0, b.text()[-3000:]
    finally:
        kill_left_over(a, b)
    assert (tmp_path / "out" / "killed-3").exists() and (tmp_path / "out" / "killed-6").exists()
    assert worlds(a) == [4, 3, 2, 4], worlds(a)

    # Each loss rolled back to the commit before the killed step, re-sharded by every survivor.
    assert collections.Counter((c, old, new) for c, old, new, _ in transitions(a) if new < old) == \
        {(2, 4, 3): 3, (5, 3, 2): 2}, a.text()[-3000:]
    joined = [t for t in transitions(a, b) if t[1:3] == (2, 4)]
    assert len(joined) == 4, a.text()[-3000:] + b.text()[-3000:]
    assert len({c for c, *_ in joined}) == 1 and joined[0][0] >= 8, joined  # one commit, after step 8
    # The joiners (B's workers) held nothing: they received their shards from the pair's memory
    # (below 0.0005 MB for the one whose rows are fewest: the line rounds that to 0.000).
    assert len(transitions(b)) == 2 and sum(received for *_, received in transitions(b)) > 0, b.text()[-3000:]
    # Their resharded events (the metrics' source) say so to the byte, each of them.
    joiners = [e for e in a.events() if e["event"] == "resharded" and e["to_world"] == 4 and e["host"] == "host-b"]
    assert len(joiners) == 2 and all(e["source"] == "memory" and e["received_bytes"] > 0 for e in joiners), joiners
    # ... and what covering the ring of 4 costs them: a copy of their shard sent per commit, one kept of another's.
    assert all(e["replica_bytes_per_commit"] == e["shard_bytes"] > 0 and e["replicas_held_bytes"] > 0
               for e in joiners), joiners
    assert_nothing_read_from_disk(a, b)
    assert not list(tmp_path.rglob("step-*")) and not list(tmp_path.rglob("manifest.json"))

    events = a.events()
    reforms = [e for e in events if e["event"] == "reform_done"]
    assert [(e["world_size"], e["failed"]) for e in reforms] == [(3, True)] * 3 + [(2, True)] * 2 + [(4, False)] * 2, \
        reforms
    # The switch to 4: the pair held the commit, the two joiners received it.
    assert all(e["sync_holders"] == 2 and e["sync_receivers"] == 2 for e in reforms[-2:]), reforms[-2:]

    # Steps at every ring: nothing committed was trained twice, but each killed step.
    rings = rank0_steps_by_ring(a)
    assert [world for world, _ in rings] == [4, 3, 2, 4], rings
    assert rings[0][1] in ([1, 2], [1, 2, 3])  # rank 0 may not see step 3 through before rank 2 dies
    assert rings[1][1] == [3, 4, 5]  # rank 0 itself dies in step 6
    assert rings[2][1] == [6, 7, 8]
    assert rings[3][1] == list(range(9, steps + 1))

    # init=: every build of every worker (4, 3, 2 and 4 of them) was on the meta device.
    made = builds(tmp_path)
    assert {build["device"] for build in made} == {"meta"}, made
    assert {p["pid"] for p in read_jsonl(tmp_path / "out" / "pids.jsonl")} <= {build["pid"] for build in made}
    assert "initialised the shards with init= (world 4)" in a.text()
    assert_equals_reference(tmp_path, steps, ["--init"])


@pytest.mark.slow
def test_sigterm_to_one_of_two_agents_is_a_graceful_leave_resharded_4_to_2_with_no_step_rerun(tmp_path, etcd_server):
    """Two agents of 2 workers; "stay" registers first, so it holds rank 0. Once the ring of 4
    has trained step 3, "leave" gets SIGTERM: its workers finish their step and the ring
    switches without them at a commit (nothing rolled back). The pair re-shards 4 -> 2 from
    its own shards and the replicas it keeps of the leavers' (--shard-replicas 1 puts them
    on the other host). A ring of 4 that reaches step 6 holds there, committing without
    training, so steps are left for the pair however late the leave lands."""
    steps = 12
    common = common_args(etcd_server, "--min-np", "2", "--max-np", "4", "--nproc-per-node", "2")
    script = ["--steps", str(steps), "--step-delay", "0.1", "--hold-below-world", "4",
              "--hold-from-step", "6", "--hold-until-world", "2"]
    stay = start(tmp_path, [*common, "--host-id", "host-stay"], script, name="stay")
    leave = None
    try:
        wait_while_running([stay], lambda: any(e["event"] == "member_joined" for e in stay.events()), 90,
                           "stay to register")
        leave = start(tmp_path, [*common, "--host-id", "host-leave"], script, name="leave")
        wait_while_running([stay, leave], lambda: any(s["world"] == 4 and s["step"] >= 3 for s in stay.steps()), 120,
                           "step 3 of the 4")
        leave.proc.send_signal(signal.SIGTERM)
        assert leave.wait(60) == 0, leave.text()[-3000:]
        assert stay.wait(120) == 0, stay.text()[-3000:]
    finally:
        kill_left_over(stay, leave)

    events = stay.events()
    left = [e for e in events if e.get("host") == "host-leave"]
    assert [e["event"] for e in left if e["event"] in ("graceful_leave", "member_left")] == \
        ["graceful_leave", "member_left"]
    assert next(e for e in left if e["event"] == "member_left")["graceful"] is True
    # The leaving workers switched at a commit and exited 0 on their own.
    exits = [e for e in left if e["event"] == "worker_exited"]
    assert [(e["exit_code"], e["signal"]) for e in exits] == [(0, None)] * 2, exits
    formed = [e for e in events if e["event"] == "round_formed"]
    # [2, 4, 2] when "stay" formed a first ring before "leave" registered (it holds at step 0).
    assert [e["world_size"] for e in formed] in ([2, 4, 2], [4, 2]) and formed[-1]["reason"].endswith("left"), formed
    stay_pids = {e["pid"] for e in events if e["event"] == "worker_started" and e["host"] == "host-stay"}
    assert {p["pid"] for p in read_jsonl(tmp_path / "out" / "pids.jsonl") if p["rank"] == 0} <= stay_pids
    # Nobody saw a failure: no worker lost, no ring broken, no rollback.
    assert not [e for e in events if e["event"] == "failure_detected"], events
    reforms = [e for e in events if e["event"] == "reform_done" and e.get("host") == "host-stay"]
    assert reforms and not any(e["failed"] for e in reforms), reforms
    assert [e["world_size"] for e in reforms][-2:] == [2, 2], reforms

    # Both of the pair re-sharded the switch's commit from 4 to 2 (replicas of the leavers' shards).
    switch = {e["commit"] for e in reforms[-2:]}
    assert len(switch) == 1, reforms
    assert [(c, old, new) for c, old, new, _ in transitions(stay) if old == 4] == [(*switch, 4, 2)] * 2, \
        stay.text()[-3000:]
    assert all(e["sync_holders"] == 2 and e["sync_receivers"] == 0 for e in reforms[-2:]), reforms[-2:]
    assert_nothing_read_from_disk(stay, leave)

    # Zero steps re-run: every step trained once by each rank of one ring, 1..k by the 4, the rest by 2.
    done = collections.defaultdict(list)
    for s in stay.steps():
        done[s["step"]].append((s["world"], s["rank"]))
    assert sorted(done) == list(range(1, steps + 1))
    k = max(step for step, by in done.items() if by[0][0] == 4)
    for step, by in done.items():
        assert sorted(by) == ([(4, r) for r in range(4)] if step <= k else [(2, 0), (2, 1)]), (step, by)
    assert 3 <= k <= 6 and k < steps
    # Only rank 0 of the first ring ever built the whole model; every other build was on meta.
    assert collections.Counter(build["device"] for build in builds(tmp_path))["cpu"] == 1
    assert_equals_reference(tmp_path, steps)
