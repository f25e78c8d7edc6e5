"""elastic/agent/addressing.py: the default --host-addr and the interface gloo/NCCL use."""

from __future__ import annotations

import socket

from elastic.agent import addressing


def _own_ipv4() -> list[tuple[str, str]]:
    """(interface, address) pairs of this machine, read independently with SIOCGIFADDR."""
    pairs = []
    for _, name in socket.if_nameindex():
        addr = addressing._ipv4_of(name)
        if addr is not None:
            pairs.append((name, addr))
    return pairs


def test_loopback_is_held_by_lo_and_debian_host_name_address_too():
    assert addressing.interface_holding("127.0.0.1") == "lo"
    assert addressing.interface_holding("127.0.1.1") == "lo"


def test_every_local_address_maps_to_its_interface():
    pairs = _own_ipv4()
    assert pairs, "no interface with an IPv4 address"
    for name, addr in pairs:
        assert addressing.interface_holding(addr) == name


def test_foreign_or_invalid_addresses_have_no_interface():
    assert addressing.interface_holding("203.0.113.77") is None  # TEST-NET-3: never local
    assert addressing.interface_holding("not-an-address") is None
    assert addressing.interface_holding("2001:db8::77") is None


def test_ipv6_loopback_is_found_when_the_host_has_ipv6():
    with open("/proc/net/if_inet6") as f:
        has_v6_loopback = any(line.split()[5] == "lo" for line in f if line.strip())
    assert addressing.interface_holding("::1") == ("lo" if has_v6_loopback else None)


def test_default_host_addr_is_the_route_source_to_etcd():
    assert addressing.default_host_addr(None, "anything") == "127.0.0.1"  # embedded etcd
    assert addressing.default_host_addr(("127.0.0.1", 2379), "anything") == "127.0.0.1"
    # A non-loopback destination leaves through an interface that holds the source address.
    own = {addr for _, addr in _own_ipv4()}
    source = addressing.route_source("192.0.2.200", 2379)
    assert source is None or source in own
    # No route: the host name's resolution, as before.
    assert addressing.default_host_addr(("no-such-host.invalid", 2379), "localhost") == "127.0.0.1"


def test_user_set_variables_win_and_nccl_gets_both():
    assert addressing.socket_ifname_env("eth0", "gloo", {}) == {"GLOO_SOCKET_IFNAME": "eth0"}
    assert addressing.socket_ifname_env("eth0", "nccl", {"NCCL_SOCKET_IFNAME": "ib0"}) == {"GLOO_SOCKET_IFNAME": "eth0"}
    # NCCL matches prefixes ("eth1" would pick "eth10" too): "=" asks for the exact interface.
    assert addressing.socket_ifname_env("eth0", "nccl", {}) == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "=eth0"}
    assert addressing.socket_ifname_env("eth1", "cpu:gloo,cuda:nccl", {}) == {
        "GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "=eth1"}
    assert addressing.socket_ifname_env(None, "gloo", {}) == {}


def test_an_agent_inside_a_namespaced_host_picks_its_own_address(netns_hosts):
    """The route to etcd on the bridge, not the host name's 127.0.0.1, and eth0 for gloo."""
    import subprocess
    import sys

    from tests.fakes.jobs import REPO

    hosts = netns_hosts(1)
    code = ("import sys; from elastic.agent import addressing as a; "
            "host, port = sys.argv[1].rsplit(':', 1); addr = a.default_host_addr((host, int(port)), 'x'); "
            "print(addr, a.interface_holding(addr))")
    out = subprocess.run(hosts[0].command([sys.executable, "-c", code, hosts.etcd_endpoint]),
                         capture_output=True, text=True, timeout=60, env={"PYTHONPATH": str(REPO)})
    assert out.stdout.split() == [hosts[0].addr, "eth0"], out.stderr
