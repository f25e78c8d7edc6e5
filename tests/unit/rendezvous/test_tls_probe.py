"""Why a TLS connection failed: OpenSSL's reasons in words, and how long a verdict is kept."""

from __future__ import annotations

import socket

import grpc
import pytest

from tests.fakes.pki import make_pki
from elastic.rendezvous.tls_probe import TlsFiles, TlsVerdicts, describe_alert, tls_refusal


@pytest.mark.parametrize("reason, words", [
    ("TLSV13_ALERT_CERTIFICATE_REQUIRED", "etcd rejected our client certificate, or we sent none"),
    ("SSLV3_ALERT_BAD_CERTIFICATE", "etcd rejected our client certificate, or we sent none"),
    ("TLSV1_ALERT_UNKNOWN_CA", "etcd rejected our client certificate, or we sent none"),
    ("SSLV3_ALERT_HANDSHAKE_FAILURE", "etcd rejected our client certificate, or we sent none"),
    ("WRONG_VERSION_NUMBER", "the TLS session failed"),
])
def test_alerts_in_words(reason, words):
    assert describe_alert(reason) == f"{words} ({reason})"


def test_a_verdict_is_kept_for_a_while_then_asked_again():
    now, asked = [0.0], []

    def probe(host, port):
        asked.append((host, port))
        return "refused" if len(asked) == 1 else None

    verdicts = TlsVerdicts(probe, keep_s=5.0, clock=lambda: now[0])
    assert verdicts.refusal("h", 1) == "refused"
    now[0] = 4.9
    assert verdicts.refusal("h", 1) == "refused" and len(asked) == 1
    assert verdicts.refusal("h", 2) is None and len(asked) == 2  # each endpoint its own
    now[0] = 5.0
    assert verdicts.refusal("h", 1) is None and len(asked) == 3


def test_nothing_listening_is_no_tls_problem(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connections are refused
    files = make_pki(tmp_path)
    assert tls_refusal("127.0.0.1", port, TlsFiles(files["ca"]), timeout=1.0) is None


def test_unusable_files_are_named():
    assert tls_refusal("127.0.0.1", 1, TlsFiles("/nonexistent/ca.pem")).startswith("cannot use the TLS files")


class _RpcError(grpc.RpcError):
    def __init__(self, details: str):
        self._details = details

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return self._details


@pytest.mark.parametrize("details, final", [
    ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:10.0.0.1:2379: Handshake read failed "
     "(Endpoint closing)", False),  # cut short (a restart, our deadline): retried
    ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:10.0.0.1:2379: Handshake read failed "
     "(Shutting down endpoint)", False),
    ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:10.0.0.1:2379: Ssl handshake failed: "
     "SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED", True),
])
def test_a_handshake_cut_short_is_retried_a_refused_one_is_final(tmp_path, details, final):
    from elastic.rendezvous.errors import RendezvousAuthError
    from elastic.rendezvous.etcd import Etcd, EtcdConfig, _TransientError

    ca = tmp_path / "ca.pem"
    ca.write_text("")
    etcd = Etcd(EtcdConfig.from_string("10.0.0.1:2379", ca_cert=str(ca)))
    etcd._tls = TlsVerdicts(lambda host, port: None)  # the server's own answer: no refusal seen
    try:
        error = etcd._classify(_RpcError(details), 0, "get")
    finally:
        etcd.close()
    assert isinstance(error, RendezvousAuthError if final else _TransientError), error
