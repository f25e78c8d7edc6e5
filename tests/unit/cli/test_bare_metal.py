"""Which host serves a bare-metal job's rendezvous: the endpoint -> this host's serving address (a table)."""

from __future__ import annotations

import os

import pytest

from elastic.cli.bare_metal import bindable, served_security, serving_address, speaks_tls
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


@pytest.mark.parametrize("address, has_secret, allow_insecure, secure, warns", [
    ("10.1.0.5", True, False, True, False),     # the job's secret: TLS + auth
    ("10.1.0.5", True, True, True, False),      # --allow-insecure never turns a given secret off
    ("127.0.0.1", True, False, True, False),    # a secret on loopback too (the clients expect TLS)
    ("127.0.0.1", False, False, False, False),  # loopback without one: this machine's processes only
    ("::1", False, False, False, False),
    ("10.1.0.5", False, True, False, True),     # off loopback, plain: only when asked, with a warning
    ("fd00::5", False, True, False, True),
])
def test_served_security(address, has_secret, allow_insecure, secure, warns):
    decision = served_security(address, has_secret, allow_insecure)
    assert decision.secure is secure
    assert bool(decision.warning) is warns
    if warns:
        assert "\n" not in decision.warning and address in decision.warning


@pytest.mark.parametrize("address", ["10.1.0.5", "node0", "fd00::5"])
def test_a_served_etcd_off_loopback_without_a_secret_is_refused_naming_the_fix(address):
    with pytest.raises(ConfigError) as refused:
        served_security(address, False, False)
    line = str(refused.value)
    assert "\n" not in line and address in line
    assert "--job-secret-file" in line and "--allow-insecure" in line and "openssl rand -hex 32" in line


def test_speaks_tls_tells_a_tls_listener_from_a_plain_one(tmp_path):
    import socket
    import ssl
    import threading

    from elastic.rendezvous.job_secret import JobSecret, new_secret

    server = JobSecret(new_secret()).server_files(str(tmp_path), ["127.0.0.1"])
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(server.cert, server.key)
    results = {}
    for tls in (True, False):
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]

        def serve(listener=listener, tls=tls):
            conn, _ = listener.accept()
            with conn:
                if tls:
                    with context.wrap_socket(conn, server_side=True):
                        pass
                else:
                    conn.recv(1024)
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        results[tls] = speaks_tls("127.0.0.1", port, timeout=5.0)
        thread.join(5)
        listener.close()
    assert results == {True: True, False: False}
    assert not speaks_tls("127.0.0.1", 1, timeout=1.0)  # nothing listening


def _routable_address_of_ours():
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.123", 9))  # no packet is sent: the route picks our address
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") or not bindable(address) else address


def test_the_endpoint_host_without_a_secret_refuses_in_one_line_before_serving(tmp_path, monkeypatch, capsys):
    from elastic.cli import launch as cli
    from elastic.rendezvous.embedded import _free_ports

    address = _routable_address_of_ours()
    if address is None:
        pytest.skip("no routable address on this machine")
    for name in [n for n in os.environ if n.startswith(("ELASTIC_", "SLURM"))]:
        monkeypatch.delenv(name)
    script = tmp_path / "t.py"
    script.write_text("")
    port = _free_ports(address, 1)[0]
    code = cli.main([f"--rdzv-endpoint={address}:{port}", "--job-id", "j", "--np", "1", "--backend", "gloo",
                     "--rdzv-timeout", "5", str(script)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("elastic-run: error: the job's etcd would be served on") and "--job-secret-file" in err[0]
    assert bindable_port(address, port)  # nothing was left listening


def bindable_port(address, port):
    import socket

    with socket.socket() as sock:
        try:
            sock.bind((address, port))
            return True
        except OSError:
            return False
