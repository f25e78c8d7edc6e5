"""A throw-away PKI for TLS tests: a CA, a server certificate for 127.0.0.1, a client one."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject: str, key, issuer: x509.Name, signer, *, ca: bool = False, usage=None, ip=None):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if ip is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]),
                                        critical=False)
    return builder.sign(signer, hashes.SHA256())


def _write_pair(directory, name: str, key, cert) -> tuple[str, str]:
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def make_pki(directory: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files in
    ``directory``: paths under the keys ca, server_cert, server_key, client_cert, client_key."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("test-ca", ca_key, _name("test-ca"), ca_key, ca=True)
    server_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    server = _certificate("etcd", server_key, ca.subject, ca_key, usage=ExtendedKeyUsageOID.SERVER_AUTH, ip="127.0.0.1")
    client = _certificate("elastic", client_key, ca.subject, ca_key, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    paths = {"ca": _write_pair(directory, "ca", ca_key, ca)[0]}
    paths["server_cert"], paths["server_key"] = _write_pair(directory, "server", server_key, server)
    paths["client_cert"], paths["client_key"] = _write_pair(directory, "client", client_key, client)
    return paths


def tls_etcd_server(binary: str, pki: dict[str, str]):
    """An (unstarted) embedded etcd that wants TLS with a client certificate from ``pki``,
    and a client configured to present it."""
    from elastic.rendezvous.embedded import EmbeddedEtcd

    return EmbeddedEtcd(
        binary=binary,
        scheme="https",
        extra_args=["--cert-file", pki["server_cert"], "--key-file", pki["server_key"],
                    "--trusted-ca-file", pki["ca"], "--client-cert-auth"],
        client_options=dict(ca_cert=pki["ca"], cert_cert=pki["client_cert"], cert_key=pki["client_key"]),
    )
