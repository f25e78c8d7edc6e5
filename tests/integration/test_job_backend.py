"""One backend per job (gpu review G7) in a real etcd: the first host records its choice, a
later host that resolved differently is held to it or refused, hosts starting at once
agree on one, and an ended job's record binds no new job of that id."""

from __future__ import annotations

import json
import threading
import uuid

import pytest

from elastic.agent.job_backend import settle
from elastic.contract.devices import CPU_AND_CUDA
from elastic.rendezvous import ConfigError, JobKeys
from elastic.rendezvous.etcd import Put


@pytest.fixture
def keys():
    return JobKeys(f"backend-{uuid.uuid4().hex[:10]}")


def test_the_first_host_records_and_a_later_one_is_held_to_it(etcd, keys):
    assert settle(etcd, keys, CPU_AND_CUDA, "a") == CPU_AND_CUDA
    assert json.loads(etcd.get(keys.backend).value) == {"backend": CPU_AND_CUDA, "host": "a"}
    assert settle(etcd, keys, CPU_AND_CUDA, "b") == CPU_AND_CUDA
    with pytest.raises(ConfigError, match="the job runs cpu:gloo,cuda:nccl \\(chosen by host a\\)"):
        settle(etcd, keys, "gloo", "c")
    assert json.loads(etcd.get(keys.backend).value)["host"] == "a"


def test_hosts_starting_at_once_agree_on_one(etcd, keys):
    results, errors = [], []

    def start(host):
        try:
            results.append(settle(etcd, keys, "gloo" if host == "h0" else CPU_AND_CUDA, host))
        except ConfigError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(f"h{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    winner = json.loads(etcd.get(keys.backend).value)
    # Whoever won, nobody runs a backend other than the record: gloo hosts are refused in a
    # GPU job, and GPU hosts in a gloo job (never turned into gloo unasked: gpu review 3, N9).
    assert set(results) == {winner["backend"]} and len(results) + len(errors) == 4
    assert len(errors) == (1 if winner["backend"] == CPU_AND_CUDA else 3)


def test_an_ended_jobs_record_does_not_bind_a_new_job_of_that_id(etcd, keys):
    lease = etcd.grant_lease(60)
    etcd.txn([], [Put(keys.backend, json.dumps({"backend": CPU_AND_CUDA, "host": "old"}).encode(), lease=lease)])
    assert settle(etcd, keys, "gloo", "new") == "gloo"
    kv = etcd.get(keys.backend)
    assert json.loads(kv.value)["host"] == "new" and kv.lease != lease


def test_the_record_hangs_on_the_job_lease_and_goes_with_an_abandoned_job(etcd, keys):
    assert settle(etcd, keys, "gloo", "a", abandoned_after=600) == "gloo"
    job_lease = etcd.get(keys.job_lease).lease
    assert job_lease and etcd.get(keys.backend).lease == job_lease
    assert settle(etcd, keys, "gloo", "b") == "gloo"  # still the job's record
    etcd.revoke_lease(job_lease)  # what its expiry does, a week after the last agent died
    assert etcd.get(keys.backend) is None
