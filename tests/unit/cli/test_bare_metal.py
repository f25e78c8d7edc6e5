"""Which host serves a bare-metal job's rendezvous: the endpoint -> this host's serving address (a table)."""

from __future__ import annotations

import pytest

from elastic.cli.bare_metal import bindable, serving_address
from elastic.rendezvous import ConfigError
from elastic.rendezvous.cluster_rpc import ClusterMember
from elastic.rendezvous.member_sync import endpoints_of

MINE = {"10.1.0.5", "192.168.7.2", "fd00::5", "127.0.0.1", "127.0.1.1"}
is_mine = MINE.__contains__


@pytest.mark.parametrize("host, resolved, host_addr, expected", [
    ("10.1.0.5", ["10.1.0.5"], None, "10.1.0.5"),                      # an address of ours
    ("192.168.7.2", ["192.168.7.2"], "10.1.0.5", "192.168.7.2"),         # another interface of ours
    ("node0", ["10.1.0.5"], None, "10.1.0.5"),                          # a name that resolves to ours
    ("node0", ["10.9.9.9", "192.168.7.2"], None, "192.168.7.2"),        # one of its addresses is ours
    ("fd00::5", ["fd00::5"], None, "fd00::5"),                          # IPv6
    ("node1", ["10.1.0.6"], None, None),                                # another host's
    ("node1", [], None, None),                                          # unresolvable here: wait for it
    ("127.0.0.1", ["127.0.0.1"], None, None),                           # loopback: never served
    ("localhost", ["127.0.0.1"], None, None),
    ("node0", ["127.0.1.1"], "10.1.0.5", "10.1.0.5"),                    # Debian's own-name trap + --host-addr
])
def test_serving_address(host, resolved, host_addr, expected):
    assert serving_address(host, resolved, is_mine, host_addr) == expected


def test_a_name_resolving_to_loopback_here_needs_host_addr():
    with pytest.raises(ConfigError, match="resolves to 127.0.1.1 .loopback. on this host: give --host-addr"):
        serving_address("node0", ["127.0.1.1"], is_mine, None)
    with pytest.raises(ConfigError):
        serving_address("node0", ["127.0.1.1"], is_mine, "10.200.0.1")  # not ours


def test_bindable_tells_our_addresses_from_others():
    assert bindable("127.0.0.1")
    assert not bindable("192.0.2.77")  # TEST-NET-1: no host holds it


def test_clients_follow_the_started_voting_members():
    members = [ClusterMember(1, "a", ("http://10.0.0.1:2380",), ("http://10.0.0.1:29400",)),
               ClusterMember(2, "", ("http://10.0.0.2:2380",), ()),  # added, not started
               ClusterMember(3, "c", ("http://10.0.0.3:2380",), ("http://10.0.0.3:4000",), is_learner=True),
               ClusterMember(4, "d", ("http://[fd00::4]:2380",), ("http://[fd00::4]:4001",))]
    assert endpoints_of(members) == (("10.0.0.1", 29400), ("fd00::4", 4001))
