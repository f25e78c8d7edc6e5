"""A malformed value in the job's etcd prefix is named once and skipped: the coordinator
forms rounds, an agent starts, ``elastic-run status`` answers (security review, finding 5).

Each kind of key a reader parses gets a value of the wrong shape: not JSON, JSON of the
wrong type, a field missing, a field of the wrong type. Real etcd, real participants.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from elastic.rendezvous import JobKeys, RendezvousSettings
from tests.fakes.jobs import REPO

pytestmark = pytest.mark.timeout(60)

BAD_VALUES = [b"not json", b"[]", b"{}", b'{"round": "x"}', b"\xff\xfe", b'{"member_id": 7}']


@pytest.mark.parametrize("bad", BAD_VALUES)
def test_bad_members_requests_and_reports_do_not_wedge_the_coordinator(etcd, local, job_id, caplog, bad):
    keys = JobKeys(job_id)
    etcd.put(keys.request("stranger.w0"), bad)
    etcd.put(keys.member("stranger"), bad)
    etcd.put(keys.reach_report("stranger"), bad)
    caplog.set_level(logging.WARNING, logger="elastic.rendezvous")
    local.add("m1", RendezvousSettings(min_np=1, max_np=1, settle=0.1))
    plan = local.wait_for_plan("m1", lambda p: True, timeout=5.0)
    assert plan.round == 1 and list(plan.worker_ids()) == ["m1/w0"]
    said = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    for key in (keys.request("stranger.w0"), keys.member("stranger"), keys.reach_report("stranger")):
        assert sum(key in line for line in said) == 1, (key, said)  # once, naming the key
    # A request carries no lease: a malformed one is deleted, not left for ever.
    assert etcd.get(keys.request("stranger.w0")) is None


@pytest.mark.parametrize("bad", BAD_VALUES)
def test_a_bad_plan_or_status_is_skipped_and_the_next_round_replaces_it(etcd, local, job_id, bad):
    keys = JobKeys(job_id)
    etcd.put(keys.plan, bad)
    etcd.put(keys.status, bad)
    etcd.put(keys.waiting, bad)
    participant = local.add("m1", RendezvousSettings(min_np=1, max_np=1, settle=0.1))
    plan = local.wait_for_plan("m1", lambda p: True, timeout=5.0)
    assert plan.round == 1
    assert participant.control.status.state == "running"
    stored = json.loads(etcd.get(keys.plan).value)
    assert stored["round"] == 1  # the unreadable plan was overwritten


def test_status_names_the_unreadable_keys_in_one_line_and_shows_the_rest(etcd_server, etcd, local, job_id):
    keys = JobKeys(job_id)
    local.add("m1", RendezvousSettings(min_np=1, max_np=1, settle=0.1))
    local.wait_for_plan("m1", lambda p: True, timeout=5.0)
    etcd.put(keys.member("stranger"), b"not json")
    etcd.put(keys.prefix + "rounds/999", b"{}")
    done = subprocess.run(
        [sys.executable, "-m", "elastic.cli", "status", "--rdzv-endpoint", etcd_server.endpoint, "--job-id", job_id],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert "unreadable keys left out: members/stranger, rounds/999" in done.stdout
    assert "m1" in done.stdout
