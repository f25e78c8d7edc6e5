"""Why a TLS connection to etcd failed, asked of the server itself.

gRPC reports a refused client certificate in words that depend on the server and on
timing: etcd 3.5 rejects it during the handshake (the status names the SSL alert),
while with etcd 3.4 the TLS 1.3 handshake completes on the client's side first and
the server's alert arrives as the first record gRPC decrypts, reported only as
``Unwrap failed (TSI_DATA_CORRUPTED)``; a server that closes at once gives ``Socket
closed``. None of these texts can be trusted to tell a certificate problem (retrying
cannot fix it) from an etcd that is down or restarting (retrying is right).

So when a secure client sees etcd unavailable, it asks the endpoint directly: a TLS
handshake with the same CA, certificate and key, then the HTTP/2 preface that every
gRPC server answers at once. A certificate the server refuses shows up as an
``ssl.SSLError`` during the handshake or at that first read, whenever the alert comes;
a server that answers has no TLS problem; one that cannot be reached is simply down.
"""

from __future__ import annotations

import socket
import ssl
import time
from dataclasses import dataclass
from typing import Callable, Optional

# The client preface of HTTP/2 and an empty SETTINGS frame: a gRPC server answers with
# its own SETTINGS frame, so a healthy TLS session yields bytes without waiting.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


@dataclass(frozen=True)
class TlsFiles:
    ca_cert: str
    cert_cert: Optional[str] = None
    cert_key: Optional[str] = None


def tls_refusal(host: str, port: int, files: TlsFiles, timeout: float = 2.0) -> Optional[str]:
    """The TLS problem between us and ``host:port`` in words, or None when there is none
    to be seen (the server answered, or could not be reached at all: a connection
    problem, not a TLS one)."""
    try:
        context = ssl.create_default_context(cafile=files.ca_cert)
        if files.cert_cert:
            context.load_cert_chain(files.cert_cert, files.cert_key)
        context.set_alpn_protocols(["h2"])
    except (OSError, ssl.SSLError) as exc:
        return f"cannot use the TLS files: {exc}"
    try:
        raw = socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return None  # down or unreachable: retrying is right
    try:
        with context.wrap_socket(raw, server_hostname=host) as tls:
            tls.settimeout(timeout)
            tls.sendall(_H2_PREFACE)
            tls.recv(1)  # the server's SETTINGS, or its alert about our certificate
    except ssl.SSLCertVerificationError as exc:
        return f"etcd's certificate does not verify against our CA ({exc.verify_message or exc.reason})"
    except ssl.SSLError as exc:
        return describe_alert(exc.reason or str(exc))
    except OSError:
        return None  # reset or timed out without a TLS alert: not a certificate problem
    finally:
        raw.close()
    return None


def describe_alert(reason: str) -> str:
    """An OpenSSL reason (``TLSV13_ALERT_CERTIFICATE_REQUIRED``) in words."""
    upper = reason.upper()
    if "CERTIFICATE_REQUIRED" in upper or "BAD_CERTIFICATE" in upper or "UNKNOWN_CA" in upper \
            or "CERTIFICATE_UNKNOWN" in upper or "HANDSHAKE_FAILURE" in upper:
        return f"etcd rejected our client certificate, or we sent none ({reason})"
    return f"the TLS session failed ({reason})"


class TlsVerdicts:
    """Remembers each endpoint's probe for a while: an outage of a TLS etcd is retried
    for up to --etcd-retry-deadline, and each retry need not shake hands again."""

    def __init__(self, probe: Callable[[str, int], Optional[str]], keep_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self._probe = probe
        self._keep_s = keep_s
        self._clock = clock
        self._seen: dict[tuple[str, int], tuple[float, Optional[str]]] = {}

    def refusal(self, host: str, port: int) -> Optional[str]:
        now = self._clock()
        seen = self._seen.get((host, port))
        if seen is not None and now - seen[0] < self._keep_s:
            return seen[1]
        verdict = self._probe(host, port)
        self._seen[(host, port)] = (now, verdict)
        return verdict
