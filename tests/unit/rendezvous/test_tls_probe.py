"""Why a TLS connection failed: OpenSSL's reasons in words, and how long a verdict is kept."""

from __future__ import annotations

import socket

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
