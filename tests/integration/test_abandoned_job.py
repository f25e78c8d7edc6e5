"""The keys of a job whose agents all died expire with the job lease (security review,
finding 10); while any agent lives, its coordinator keeps them. Real etcd, real leases."""

from __future__ import annotations

import pytest

from elastic.rendezvous import JobKeys, RendezvousSettings
from tests.fakes.waiting import poll

pytestmark = pytest.mark.timeout(90)

ABANDONED_AFTER = 4.0  # seconds here; a week by default (keys.JOB_LEASE_S)


def test_an_abandoned_jobs_keys_expire_and_a_living_jobs_are_kept(etcd, local, job_id):
    keys = JobKeys(job_id)
    settings = RendezvousSettings(min_np=2, max_np=2, settle=0.1, abandoned_after=ABANDONED_AFTER)
    first = local.add("m1", settings, ttl=2.0)
    local.add("m2", settings, ttl=2.0)
    plan = local.wait_for_plan("m1", lambda p: True)
    first.control.request_reset("m1/w0", plan.round, "a worker's ring broke")  # as a worker writes it
    assert poll(lambda: first.control.job_lease, 5)
    written = {kv.key: kv.lease for kv in etcd.get_prefix(keys.prefix)[0]}
    for key in (keys.plan, keys.round(plan.round), keys.request("m1/w0"), keys.job_lease):
        assert written.get(key) == first.control.job_lease, key
    # Alive well past the lease's length: the coordinator refreshes it.
    assert not poll(lambda: etcd.get(keys.plan) is None, 2 * ABANDONED_AFTER, interval=0.5)
    for member_id in list(local.by_id):
        local.abandon(member_id)
    gone = poll(lambda: not etcd.get_prefix(keys.prefix)[0], ABANDONED_AFTER + 2 * 2.0 + 5)
    assert gone, [kv.key for kv in etcd.get_prefix(keys.prefix)[0]]
