"""A real three-member etcd cluster on loopback, for tests that kill its leader.

Built with ``rendezvous.embedded.EmbeddedEtcdCluster``: every member a real etcd
process with its own ports and data dir, etcd's default raft timers.

    leader = etcd_cluster.leader()          # the member that leads now
    leader.kill()                           # SIGKILL; the others elect a new one
    etcd_cluster.wait_leader(60, not_=leader)
"""

from __future__ import annotations

import pytest

from elastic.rendezvous.embedded import EmbeddedEtcdCluster


@pytest.fixture
def etcd_cluster(tmp_path):
    """A started three-member cluster of this test's own; stopped after the test.
    Member logs stay in the test's directory."""
    (tmp_path / "etcd-cluster").mkdir()
    cluster = EmbeddedEtcdCluster(3, log_dir=str(tmp_path / "etcd-cluster")).start()
    yield cluster
    cluster.stop()
