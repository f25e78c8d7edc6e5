"""Chaos soak, CI's form: 100 mixed faults on four namespaced hosts (tests/chaos/soak_bed.py
says which faults and what is checked; benchmarks/soak.py runs 1,000 and more).

A seeded schedule (the seed is printed; ``SOAK_SEED`` replays it, ``SOAK_FAULTS`` sets the
count): every fault recovered from before the next, no recovery over 2 s but of the
faults that last longer by nature (a hang's bound, a lease's TTL), the final parameters
those of a single-process run (1e-9; float64), every step from 1 to the last present and
at most one re-run per failure, every agent exit 0, and nothing leaked: processes,
descriptors and threads of the agents that lived throughout, the job's etcd keys, the
agents' private directories.
"""

from __future__ import annotations

import os

import pytest

from elastic.rendezvous.embedded import EmbeddedEtcdCluster
from tests.chaos.soak_bed import HOSTS, run_soak

FAULTS = int(os.environ.get("SOAK_FAULTS", "100"))
# The whole soak (faults, start-up, stop, the reference run): about 5-6 s a fault on the
# 2-core machine at load 2-3, twice that under load; asserted at 15 s a fault.
BUDGET_S = 15.0 * FAULTS + 120
pytestmark = [pytest.mark.slow, pytest.mark.timeout(BUDGET_S + 180)]


@pytest.fixture
def etcd_cluster(netns_hosts, tmp_path):
    hosts = netns_hosts(HOSTS, etcd=False)
    cluster = EmbeddedEtcdCluster(3, host=hosts.bridge_addr, log_dir=str(tmp_path))
    try:
        yield hosts, cluster.start()
    finally:
        cluster.stop()


def test_soak_of_mixed_faults_recovers_every_one_leaks_nothing_and_ends_equal_to_one_process(
        etcd_cluster, tmp_path, capsys):
    hosts, cluster = etcd_cluster
    seed = int(os.environ.get("SOAK_SEED") or int.from_bytes(os.urandom(4), "little"))

    def say(line: str) -> None:
        with capsys.disabled():
            print(line, flush=True)

    result = run_soak(hosts, cluster, tmp_path, FAULTS, seed, say)
    say(f"soak: seed {seed}, {result['faults']} faults, {result['steps']} steps, {result['rerun']} re-run "
        f"({result['failures']} failures), max |param - reference| {result['max_abs_diff']:.2e}; "
        f"{result['elapsed_s']:.0f}s + reference {result['reference_s']:.0f}s; load {result['load_average']:.1f}")
    assert result["problems"] == []
    assert result["elapsed_s"] + result["reference_s"] <= BUDGET_S
