"""Proof of death: only a refused connection counts (liveness.agent_refuses)."""

import socket

from elastic.rendezvous.liveness import agent_refuses


def test_a_listening_agent_is_alive():
    with socket.create_server(("127.0.0.1", 0)) as server:
        assert not agent_refuses("127.0.0.1", server.getsockname()[1])


def test_a_closed_port_on_a_live_host_is_proof_of_death():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
    assert agent_refuses("127.0.0.1", port)

