"""The namespaced-hosts test bed itself: links, cuts, heals, tear-down and the sweep."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.fakes import netns
from tests.fakes.jobs import REPO
from tests.fakes.waiting import poll

_PUT_AND_GET = (
    "import sys\n"
    "from rendezvous.etcd import Etcd, EtcdConfig\n"
    "host, port = sys.argv[1].rsplit(':', 1)\n"
    "with Etcd(EtcdConfig(endpoints=((host, int(port)),))) as etcd:\n"
    "    etcd.put('/netns-probe', b'hello')\n"
)


def _names(prefix: str) -> set[str]:
    """Our namespaces and links that start with ``prefix`` (one ``Hosts``' own): another
    test run on this machine makes and removes its own at any time."""
    namespaces, links = netns.existing()
    return {name for name in (*namespaces, *links) if name.startswith(prefix)}


def test_hosts_reach_each_other_and_etcd_and_own_loopback(netns_hosts):
    hosts = netns_hosts(3)
    etcd_port = hosts.etcd.client_port
    for host in hosts:
        assert host.reaches(hosts.bridge_addr, etcd_port), host
        assert host.reaches("127.0.0.1", 9), f"{host}: loopback is down"
        assert not host.reaches("192.0.2.2", 22, timeout=0.5), f"{host} reaches beyond the bridge"
    assert hosts[0].reaches(hosts[2].addr, 9)
    assert len({host.addr for host in hosts}) == 3
    # A real etcd request from inside a host, over its link.
    put = hosts[1].run([sys.executable, "-c", _PUT_AND_GET, hosts.etcd_endpoint],
                       env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.PIPE)
    assert put.wait(60) == 0, put.stderr.read()


def test_cut_isolates_a_host_and_heal_restores_it(netns_hosts):
    hosts = netns_hosts(3)
    etcd = (hosts.bridge_addr, hosts.etcd.client_port)
    hosts[1].cut()
    assert not hosts[1].reaches(*etcd)
    assert not hosts[1].reaches(hosts[0].addr, 9)
    assert not hosts[0].reaches(hosts[1].addr, 9)
    assert hosts[0].reaches(hosts[2].addr, 9) and hosts[2].reaches(*etcd)
    hosts[1].heal()
    assert poll(lambda: hosts[1].reaches(*etcd) and hosts[0].reaches(hosts[1].addr, 9), 15)


def test_cut_peers_keeps_etcd_and_cut_etcd_keeps_peers(netns_hosts):
    hosts = netns_hosts(3)
    etcd = (hosts.bridge_addr, hosts.etcd.client_port)
    hosts[2].cut_peers()
    assert hosts[2].reaches(*etcd)
    assert not hosts[2].reaches(hosts[0].addr, 9)
    assert not hosts[1].reaches(hosts[2].addr, 9)
    assert hosts[0].reaches(hosts[1].addr, 9)
    hosts[2].heal()
    assert poll(lambda: hosts[2].reaches(hosts[0].addr, 9) and hosts[1].reaches(hosts[2].addr, 9), 15)

    hosts[0].cut_etcd()
    assert not hosts[0].reaches(*etcd)
    assert hosts[0].reaches(hosts[1].addr, 9) and hosts[2].reaches(hosts[0].addr, 9)
    assert hosts[1].reaches(*etcd)
    hosts[0].heal()
    assert poll(lambda: hosts[0].reaches(*etcd), 15)


def test_destroy_removes_everything_and_kills_what_runs_inside(netns_hosts):
    netns_hosts(0)  # skips where namespaces cannot be made
    hosts = netns.Hosts(2, etcd=False)
    try:
        sleeper = hosts[0].run(["sleep", "600"], start_new_session=True)
        assert _names(hosts.prefix) == {hosts.bridge, hosts[0].name, hosts[1].name, hosts[0].veth, hosts[1].veth}
    finally:
        hosts.destroy()
    assert sleeper.poll() is not None
    assert _names(hosts.prefix) == set()
    assert not (netns.REGISTRY / hosts.run_id).exists()


def test_sweep_removes_a_dead_runs_leftovers_only(netns_hosts):
    live = netns_hosts(1, etcd=False)
    live_names = _names(live.prefix)
    crashed = netns.Hosts(1, etcd=False)
    (netns.REGISTRY / crashed.run_id).write_text("999999999\n")  # an owner that no longer exists
    try:
        removed = netns.sweep_leftovers()
        # Only the dead run's names go: a test run beside this one (alive) keeps its own.
        # (Its own sweep may have taken some of the dead run's names first.)
        assert set(removed) <= {crashed.bridge, crashed[0].veth, crashed[0].name}
        assert _names(crashed.prefix) == set()
        assert _names(live.prefix) == live_names
        assert live[0].reaches(live.bridge_addr, 9)
    finally:
        crashed.destroy()
