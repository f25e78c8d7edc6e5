"""The etcd a bare-metal job serves itself (rendezvous/served.py), with real etcd members.

Four "hosts" on loopback addresses 127.0.0.1-4 (each a ServedRendezvous with its own
client): the first holds the first member; the others offer, and the steward brings the
cluster to three voting members through learners; then host 0 crashes (its client closed,
its member SIGKILLed, its lease left to expire): its member is removed and replaced by
host 3's, and a client that followed the member list talks to the survivors.
tests/hosts/test_bare_metal_launch.py runs the same with whole jobs on namespaced hosts.
"""

from __future__ import annotations

import pytest

from elastic.rendezvous import Etcd, EtcdConfig
from elastic.rendezvous.cluster_rpc import member_list
from elastic.rendezvous.embedded import _free_ports
from elastic.rendezvous.member_sync import follow_members
from elastic.rendezvous.served import ServedRendezvous, first_member, is_served
from tests.conftest import etcd_binary_or_skip
from tests.fakes.jobs import wait_until

pytestmark = pytest.mark.timeout(90)

ADDRS = ["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4"]
TTL = 2.0
TICK = 0.25  # the steward's pace (1 s in a job)


def voting(etcd: Etcd) -> set[str]:
    try:
        return {m.name.split("-")[1] for m in member_list(etcd, deadline=1.0) if m.started and not m.is_learner}
    except Exception:  # noqa: BLE001 - a leader change: ask again
        return set()


def test_three_members_through_learners_and_a_lost_one_replaced(tmp_path):
    etcd_binary_or_skip()
    first = first_member(ADDRS[0], _free_ports(ADDRS[0], 1)[0], "h0", str(tmp_path))
    clients = [follow_members(Etcd(EtcdConfig.from_string(first.endpoint, member_sync=0.5, retry_deadline=5.0)))
               for _ in ADDRS]
    hosts: list[ServedRendezvous] = []
    try:
        assert is_served(clients[1])  # its members' names say so
        for i, addr in enumerate(ADDRS[:3]):
            hosts.append(ServedRendezvous(clients[i], f"h{i}", addr, TTL, member=first if i == 0 else None,
                                          log_dir=str(tmp_path), tick=TICK).start())
        wait_until(lambda: voting(clients[1]) == {"h0", "h1", "h2"}, 40, "three voting members")
        actions = [a for host in hosts for a in host.actions]
        assert sum("as a learner" in a for a in actions) == 2 and sum("promoted" in a for a in actions) == 2, actions
        wait_until(lambda: len(clients[2].config.endpoints) == 3, 10, "a client to follow the three members")

        hosts.append(ServedRendezvous(clients[3], "h3", ADDRS[3], TTL, log_dir=str(tmp_path),
                                      tick=TICK).start())
        clients[0].close()  # host 0 crashes: no request of its own any more, its lease expires
        first.kill()
        wait_until(lambda: voting(clients[1]) == {"h1", "h2", "h3"}, 40, "host 0's member replaced by host 3's")
        wait_until(lambda: first.endpoint not in clients[2].config.describe(), 10, "clients to drop host 0")
        clients[2].put("/served-test/after", b"1")  # served by the survivors
        assert clients[1].get("/served-test/after").value == b"1"
    finally:
        for host in reversed(hosts):
            host.stop()
        for client in clients:
            client.close()
        first.stop()
