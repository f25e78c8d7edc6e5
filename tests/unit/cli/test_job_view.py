"""job_view: the snapshot of a job's keys -> what `elastic-run status` shows (no etcd)."""

from __future__ import annotations

import io
import json

from elastic.cli.status import render_text
from elastic.rendezvous.control import JobStatus
from elastic.rendezvous.waiting import WaitingEcho, WaitingLine, WaitingNotice
from elastic.rendezvous.job_view import JobSnapshot, job_view
from elastic.rendezvous.rounds import Member, RoundPlan, Slot

NOW = 1_700_000_000.0


def member(member_id, host, workers, joined=NOW - 60, draining=False):
    return Member(member_id, host, f"10.0.0.{len(host)}", 29500, tuple(workers), joined, draining=draining)


def plan(number, slots, reason="", lost=()):
    hosts = {s.member_id: (s.member_id.split("-")[0], "10.0.0.1") for s in slots}
    return RoundPlan(number, tuple(slots), hosts, "10.0.0.1:29500", NOW - 100 + number, lost=lost, reason=reason)


def snapshot(**values):
    return JobSnapshot("job", {k.replace("__", "/"): v for k, v in values.items()}, NOW)


def running_job():
    a, b = member("a-1", "hosta", ["a-1.w0", "a-1.w1"]), member("b-1", "hostb", ["b-1.w0"], joined=NOW - 30)
    r1 = plan(1, [Slot("a-1", "a-1.w0"), Slot("a-1", "a-1.w1")], "max_np=2 workers present")
    r2 = plan(2, [Slot("a-1", "a-1.w0"), Slot("a-1", "a-1.w1"), Slot("b-1", "b-1.w0")], "1 worker(s) joined")
    return {
        "members/a-1": a.to_json(), "members/b-1": b.to_json(), "coordinator": b"a-1",
        "control/plan": r2.to_json(), "rounds/00000001": r1.to_json(), "rounds/00000002": r2.to_json(),
        "requests/b-1.w0": json.dumps({"round": 2, "reason": "ring broken", "lost": []}).encode(),
    }


def test_a_running_job_shows_round_world_coordinator_members_with_ranks_rounds_and_requests():
    view = job_view(JobSnapshot("job", running_job(), NOW))
    assert (view.state, view.round, view.world_size, view.coordinator) == ("running", 2, 3, "a-1")
    assert [(m.host, [(w.worker_id, w.rank) for w in m.workers], m.coordinator) for m in view.members] == [
        ("hosta", [("a-1.w0", 0), ("a-1.w1", 1)], True), ("hostb", [("b-1.w0", 2)], False)]
    assert [(r.round, r.world_size, r.reason) for r in view.rounds] == [
        (2, 3, "1 worker(s) joined"), (1, 2, "max_np=2 workers present")]
    assert [(q.worker_id, q.round, q.reason) for q in view.requests] == [("b-1.w0", 2, "ring broken")]
    assert view.note == "" and view.history_expires_in is None
    encoded = json.loads(json.dumps(view.to_dict()))
    assert encoded["state"] == "running" and encoded["round"] == 2 and encoded["world_size"] == 3
    assert [m["host"] for m in encoded["members"]] == ["hosta", "hostb"]
    text = render_text(view, NOW)
    assert text.splitlines()[0] == "job job: running"
    assert "round 2, world size 3" in text and "coordinator: hosta (a-1)" in text
    assert "w0=rank 0, w1=rank 1" in text and "b-1.w0 after round 2: ring broken" in text


def test_an_ended_job_shows_how_it_ended_and_when_its_record_expires():
    values = running_job()
    for key in ("members/a-1", "members/b-1", "coordinator", "requests/b-1.w0"):
        del values[key]
    values["control/status"] = JobStatus("failed", "worker a-1.w0 failed: ValueError: bad", NOW - 10).to_json()
    view = job_view(JobSnapshot("job", values, NOW, history_ttl=86000.0))
    assert (view.state, view.reason, view.since, view.members) == (
        "failed", "worker a-1.w0 failed: ValueError: bad", NOW - 10, ())
    assert view.round == 2 and view.history_expires_in == 86000.0
    text = render_text(view, NOW)
    assert text.splitlines()[0].startswith("job job: failed: worker a-1.w0 failed: ValueError: bad (since ")
    assert "expires in 23.9 h" in text


def test_spares_have_no_rank_and_a_job_waiting_for_its_first_round_says_so():
    values = {"members/a-1": member("a-1", "hosta", ["a-1.w0"]).to_json()}
    view = job_view(JobSnapshot("job", values, NOW))
    assert view.round is None and view.world_size == 0
    assert view.members[0].workers[0].rank is None
    assert view.note == "waiting for the first round: 1 worker(s) offered"
    assert "w0=spare" in render_text(view, NOW)
    # Below min_np, the coordinator's notice says how many of how many are there.
    values["control/waiting"] = WaitingNotice(present=1, min_np=2, fails_in=500.0).to_json()
    view = job_view(JobSnapshot("job", values, NOW))
    assert view.note == "waiting for workers: 1 of 2 present (the job fails if --rdzv-timeout runs out first)"


def test_a_running_job_without_members_says_every_agent_is_gone():
    values = running_job()
    for key in ("members/a-1", "members/b-1", "coordinator"):
        del values[key]
    view = job_view(JobSnapshot("job", values, NOW))
    assert view.state == "running" and "every agent has left or died" in view.note


def test_old_plans_without_a_reason_still_read():
    body = json.loads(plan(3, [Slot("a-1", "a-1.w0")]).to_json())
    del body["reason"]
    assert RoundPlan.from_json(json.dumps(body).encode()).reason == ""
    assert JobStatus.from_json(b'{"state": "succeeded", "reason": "done"}').since == 0.0


def test_the_waiting_line_comes_at_once_on_a_change_and_every_interval():
    line = WaitingLine(min_np=4, interval=5.0)
    assert line.report(2, 580.2, now=0.0) == "waiting for workers: 2 of 4 present, failing in 580 s"
    assert line.report(2, 579.0, now=1.0) is None
    assert line.report(3, 578.0, now=2.0) == "waiting for workers: 3 of 4 present, failing in 578 s"
    assert line.report(3, 573.0, now=7.0) == "waiting for workers: 3 of 4 present, failing in 573 s"
    line.reset()
    assert line.report(3, 600.0, now=7.5) is not None


def test_an_agent_that_does_not_lead_echoes_the_notice_on_its_own_clock():
    now = [100.0]
    echo = WaitingEcho(interval=5.0, clock=lambda: now[0])
    notice = WaitingNotice.from_json(WaitingNotice(present=3, min_np=4, fails_in=580.4).to_json())
    assert echo.tick(notice, received_at=99.0) == "waiting for workers: 3 of 4 present, failing in 579 s"
    now[0] = 102.0
    assert echo.tick(notice, received_at=99.0) is None  # within the interval
    now[0] = 105.0
    assert echo.tick(notice, received_at=99.0) == "waiting for workers: 3 of 4 present, failing in 574 s"
    assert echo.tick(None, received_at=0.0) is None  # the wait ended
    now[0] = 106.0
    assert echo.tick(WaitingNotice(2, 4, 10.0), received_at=106.0) == \
        "waiting for workers: 2 of 4 present, failing in 10 s"


def test_watch_draws_each_read_and_shows_a_failed_read_as_one_line(monkeypatch):
    from elastic.cli import status as status_command
    from elastic.rendezvous import JobKeys, RendezvousConnectionError

    first = (job_view(JobSnapshot("job", running_job(), NOW)), None)  # no progress published yet
    reads = iter([RendezvousConnectionError("cannot reach etcd at x:1"), first])

    def view(_etcd, _keys):
        item = next(reads)
        if isinstance(item, Exception):
            raise item
        return item

    monkeypatch.setattr(status_command, "_view", view)
    waits = []
    out = io.StringIO()
    code = status_command._watch(None, JobKeys("job"), True, out, first,
                                 lambda seconds: waits.append(seconds) or len(waits) == 3)
    lines = out.getvalue().splitlines()
    assert code == 0 and waits == [2.0, 2.0, 2.0]
    assert [json.loads(lines[0])["round"], lines[1], json.loads(lines[2])["round"]] == [
        2, "elastic-run status: cannot reach etcd at x:1; trying again", 2]


def test_status_shows_the_progress_rank_0_publishes_and_ignores_a_malformed_one():
    from elastic.cli.status import progress_of_snapshot, render_text
    from elastic.timeline.progress import JobProgress

    values = running_job()
    values["progress"] = JobProgress(step=40, at=NOW - 2, steps_per_s=10.0, total_steps=100).to_json()
    progress = progress_of_snapshot(values)
    text = render_text(job_view(JobSnapshot("job", values, NOW)), NOW, progress)
    assert "progress: step 40 of 100 (40%), 10 steps/s; last commit 2.0 s ago" in text
    assert "time left: about 6.0 s at this rate" in text
    values["progress"] = b"{not json"
    assert progress_of_snapshot(values) is None
