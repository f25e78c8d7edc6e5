"""The etcd a bare-metal job serves itself (rendezvous/served.py), with real etcd members.

Four "hosts" on loopback addresses 127.0.0.1-4 (each a ServedRendezvous with its own
client): the first holds the first member; the others offer, and the steward brings the
cluster to three voting members through learners; then host 0 crashes (its client closed,
its member SIGKILLed, its lease left to expire): its member is removed and replaced by
host 3's, and a client that followed the member list talks to the survivors.
tests/hosts/test_bare_metal_launch.py runs the same with whole jobs on namespaced hosts.

It runs secured, as a job does off loopback: TLS to clients and between members (peer
certificates of the job's CA), auth on, members changed as root. A process without the
secret (with the CA, which is no secret, or without it) can neither read the job's keys
nor add or remove a member.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic.rendezvous import Etcd, EtcdConfig, RendezvousError
from elastic.rendezvous.cluster_rpc import member_add, member_list, member_remove
from elastic.rendezvous.embedded import _free_ports
from elastic.rendezvous.job_secret import JOB_USER, JobSecret, new_secret
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


def _refused(action) -> str:
    try:
        action()
    except RendezvousError as exc:
        return str(exc)
    raise AssertionError("a process without the job's secret was served")


def assert_strangers_refused(endpoint: str, ca_cert: str, member_id: int) -> None:
    """Without the secret: no read, no write, no member change (with the CA or without)."""
    plain = EtcdConfig.from_string(endpoint, retry_deadline=1.0, call_timeout=1.0)
    with Etcd(plain) as stranger:  # plaintext to a TLS server
        _refused(lambda: stranger.get("/elastic/x"))
    anonymous = EtcdConfig.from_string(endpoint, ca_cert=ca_cert, retry_deadline=1.0, call_timeout=1.0)
    wrong = EtcdConfig.from_string(endpoint, ca_cert=ca_cert, user=JOB_USER, password="guessed",
                                   retry_deadline=1.0, call_timeout=1.0)
    with Etcd(anonymous) as stranger:  # TLS with the CA, no password: etcd's auth refuses
        _refused(lambda: stranger.get("/elastic/x"))
        _refused(lambda: stranger.put("/elastic/x", b"1"))
        _refused(lambda: member_add(stranger, "https://127.0.0.9:1", learner=True, deadline=2.0))
        _refused(lambda: member_remove(stranger, member_id, deadline=2.0))
    with Etcd(wrong) as stranger:
        _refused(lambda: stranger.get("/elastic/x"))
    other = JobSecret(new_secret())  # another job's secret: its own CA, which this server's certificate fails
    (Path(ca_cert).parent / "other").mkdir(exist_ok=True)
    with Etcd(EtcdConfig.from_string(endpoint, ca_cert=other.client_files(str(Path(ca_cert).parent / "other"))
                                     .ca_cert, retry_deadline=1.0, call_timeout=1.0)) as stranger:
        _refused(lambda: stranger.get("/elastic/x"))


def test_three_members_through_learners_and_a_lost_one_replaced(tmp_path):
    etcd_binary_or_skip()
    js = JobSecret(new_secret())
    files = js.client_files(str(tmp_path))
    first = first_member(ADDRS[0], _free_ports(ADDRS[0], 1)[0], "h0", str(tmp_path), security=js)
    config = EtcdConfig.from_string(first.endpoint, member_sync=0.5, retry_deadline=5.0, ca_cert=files.ca_cert,
                                    user=files.user, password=js.password)
    clients = [follow_members(Etcd(config)) for _ in ADDRS]
    hosts: list[ServedRendezvous] = []
    try:
        assert is_served(clients[1])  # its members' names say so
        for i, addr in enumerate(ADDRS[:3]):
            hosts.append(ServedRendezvous(clients[i], f"h{i}", addr, TTL, member=first if i == 0 else None,
                                          log_dir=str(tmp_path), tick=TICK, security=js).start())
        wait_until(lambda: voting(clients[1]) == {"h0", "h1", "h2"}, 40, "three voting members")
        members = member_list(clients[1])
        assert all(url.startswith("https://") for m in members for url in (*m.peer_urls, *m.client_urls)), members
        assert_strangers_refused(members[1].client_urls[0], files.ca_cert, members[1].id)
        assert voting(clients[1]) == {"h0", "h1", "h2"}  # nothing a stranger did changed them
        actions = [a for host in hosts for a in host.actions]
        assert sum("as a learner" in a for a in actions) == 2 and sum("promoted" in a for a in actions) == 2, actions
        wait_until(lambda: len(clients[2].config.endpoints) == 3, 10, "a client to follow the three members")

        hosts.append(ServedRendezvous(clients[3], "h3", ADDRS[3], TTL, log_dir=str(tmp_path),
                                      tick=TICK, security=js).start())
        clients[0].close()  # host 0 crashes: no request of its own any more, its lease expires
        first.kill()
        wait_until(lambda: voting(clients[1]) == {"h1", "h2", "h3"}, 40, "host 0's member replaced by host 3's")
        wait_until(lambda: first.endpoint not in clients[2].config.describe(), 10, "clients to drop host 0")
        clients[2].put("/elastic/served-test/after", b"1")  # served by the survivors
        assert clients[1].get("/elastic/served-test/after").value == b"1"
    finally:
        for host in reversed(hosts):
            host.stop()
        for client in clients:
            client.close()
        first.stop()
