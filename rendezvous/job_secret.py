"""A job's own etcd, reachable only by the job: TLS and etcd users from one per-job secret.

An embedded etcd on anything but loopback (Slurm's first node, a bare-metal endpoint
host) is reachable by every user of the cluster, at a port they can often compute. A
random secret that only the job's user can read (a 0600 file, or the job's own
environment) is all the hosts of the job share; everything else is derived from it,
the same way on every host, with nothing else to copy around:

- **a CA**: an EC P-256 key from an HKDF of the secret (``ec.derive_private_key``), in a
  certificate whose every field is fixed. The host that serves etcd issues itself a
  server certificate signed by it (a fresh key, its own names); every client trusts
  only that CA. A squatter on the port, or any server started with another secret,
  fails the TLS handshake: the client refuses it and never follows it.
- **etcd users**: ``root`` (its password derived from the secret; used only to enable
  auth) and ``elastic`` with a role that may read and write the job prefix (``/elastic/``)
  and nothing else; the agents and workers log in as ``elastic``.

Why password auth and not client certificates (``--client-cert-auth``): every client
already speaks user/password (``EtcdConfig``), the CA's private key then never has to
be written anywhere, and the password reaches workers as a 0600 file path, not a
certificate and key per process. TLS keeps the password off the wire; the password
keeps strangers who complete a handshake out.

The API (also used for the bare-metal endpoint host)::

    secret = new_secret()                    # 64 hex digits, once per job
    write_secret_file(path, secret)          # 0600, atomically; read_secret_file(path) refuses a readable one
    js = JobSecret(secret)
    js.client_files(private_dir)             # -> ClientFiles(ca_cert, user, password_file): EtcdConfig's options
    EmbeddedEtcd(host=addr, port=p, security=js).start()   # TLS + auth on before anyone uses it
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import secrets
import stat
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

from .errors import ConfigError

SECRET_ENV = "ELASTIC_JOB_SECRET"  # the secret itself (the job's own environment)
SECRET_FILE_ENV = "ELASTIC_JOB_SECRET_FILE"  # or a 0600 file holding it
JOB_USER = "elastic"
JOB_ROLE = "elastic-job"
ROOT_USER = "root"
_MIN_SECRET_CHARS = 32
# Fixed so that every host derives the very same CA certificate.
_CA_NOT_BEFORE = datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc)
_CA_NOT_AFTER = datetime.datetime(2100, 1, 1, tzinfo=datetime.timezone.utc)


def new_secret() -> str:
    """A fresh job secret: 256 random bits as 64 hex digits."""
    return secrets.token_hex(32)


def check_secret(secret: str, where: str = "the job secret") -> str:
    secret = secret.strip()
    if len(secret) < _MIN_SECRET_CHARS or any(c.isspace() for c in secret):
        raise ConfigError(f"{where} is too short or malformed: expected at least {_MIN_SECRET_CHARS} characters "
                          f"without spaces (e.g. `openssl rand -hex 32`)")
    return secret


def write_private_file(path: str, data: bytes, *, exclusive: bool = False) -> str:
    """Write ``data`` to ``path`` as a 0600 file, atomically (a reader never sees half of it).
    ``exclusive``: refuse (ConfigError, one line) when ``path`` exists already."""
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask, or a file left by someone else
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    if not exclusive:
        os.replace(tmp, path)
        return path
    try:
        os.link(tmp, path)  # fails if path exists, whoever made it
    except FileExistsError:
        raise ConfigError(f"{path} exists already: another launcher of this job wrote it "
                          f"(remove it if none runs)") from None
    finally:
        os.unlink(tmp)
    return path


def write_secret_file(path: str, secret: str, *, exclusive: bool = False) -> str:
    return write_private_file(path, (check_secret(secret) + "\n").encode(), exclusive=exclusive)


def read_private_file(path: str, what: str) -> str:
    """The text of a secret file that only its owner can read; ConfigError (one line) otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        # Group bits are allowed on root's files only: a Kubernetes Secret volume is
        # root-owned, readable by the pod's fsGroup (its own), never by other users.
        exposed = stat.S_IRWXO | (0 if info.st_uid == 0 else stat.S_IRWXG)
        if info.st_mode & exposed:
            raise ConfigError(f"{what} {path} can be read by other users (mode {stat.S_IMODE(info.st_mode):o}): "
                              f"chmod 600 it")
        if info.st_uid not in (os.getuid(), 0):
            raise ConfigError(f"{what} {path} belongs to another user (uid {info.st_uid})")
        data = os.read(fd, 1 << 16)
    finally:
        os.close(fd)
    return data.decode("utf-8", "replace").rstrip("\r\n")


def read_secret_file(path: str) -> str:
    return check_secret(read_private_file(path, "job secret file"), f"job secret file {path}")


def secret_from_env(environ: Mapping[str, str]) -> Optional[str]:
    """``ELASTIC_JOB_SECRET``, else the file ``ELASTIC_JOB_SECRET_FILE`` names, else None."""
    if environ.get(SECRET_ENV):
        return check_secret(environ[SECRET_ENV], SECRET_ENV)
    if environ.get(SECRET_FILE_ENV):
        return read_secret_file(environ[SECRET_FILE_ENV])
    return None


@dataclass(frozen=True)
class ClientFiles:
    """What a client of the job's etcd needs: EtcdConfig(ca_cert=, user=, password=read(password_file))."""

    ca_cert: str
    user: str
    password_file: str


@dataclass(frozen=True)
class ServerFiles:
    cert: str
    key: str


def client_paths(directory: str) -> ClientFiles:
    """Where ``JobSecret.client_files`` writes into ``directory`` (known before the secret is)."""
    return ClientFiles(ca_cert=os.path.join(directory, "job-ca.pem"), user=JOB_USER,
                       password_file=os.path.join(directory, "job-etcd-password"))


class JobSecret:
    """Everything derived from one job secret. Deterministic except server certificates."""

    def __init__(self, secret: str):
        self._secret = check_secret(secret).encode()
        self._ca_key = None
        self._ca_cert = None

    def _derive(self, purpose: str, length: int = 32) -> bytes:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        return HKDF(algorithm=hashes.SHA256(), length=length, salt=b"elastic-run job secret v1",
                    info=purpose.encode()).derive(self._secret)

    @property
    def fingerprint(self) -> str:
        """A short public name of the secret (logs may show it; it reveals nothing)."""
        return hashlib.sha256(self._derive("fingerprint")).hexdigest()[:12]

    @property
    def root_password(self) -> str:
        return self._derive("etcd root password").hex()

    @property
    def password(self) -> str:
        """The job user's password (agents and workers log in with it)."""
        return self._derive("etcd job password").hex()

    def _ca(self):
        if self._ca_cert is None:
            from cryptography import x509
            from cryptography.hazmat.primitives import hashes
            from cryptography.hazmat.primitives.asymmetric import ec
            from cryptography.x509.oid import NameOID

            order = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551  # P-256's
            scalar = int.from_bytes(self._derive("ca key", 48), "big") % (order - 1) + 1
            key = ec.derive_private_key(scalar, ec.SECP256R1())
            name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"elastic-run job CA {self.fingerprint}")])
            self._ca_cert = (
                x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(int.from_bytes(self._derive("ca serial", 16), "big") >> 1 | 1)
                .not_valid_before(_CA_NOT_BEFORE).not_valid_after(_CA_NOT_AFTER)
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False),
                               critical=True)
                .sign(key, hashes.SHA256())
            )
            self._ca_key = key
        return self._ca_key, self._ca_cert

    def ca_pem(self) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return self._ca()[1].public_bytes(serialization.Encoding.PEM)

    def client_files(self, directory: str) -> ClientFiles:
        """Write the CA certificate and the job user's password (0600) into ``directory``
        (which should be private: 0700, the job's own)."""
        files = client_paths(directory)
        write_private_file(files.ca_cert, self.ca_pem())
        write_private_file(files.password_file, self.password.encode())
        return files

    def server_files(self, directory: str, names: Iterable[str]) -> ServerFiles:
        """A fresh server key and certificate for ``names`` (host names and IP addresses),
        signed by the job's CA, written 0600 into ``directory``."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        ca_key, ca_cert = self._ca()
        key = ec.generate_private_key(ec.SECP256R1())
        alt = []
        for name in dict.fromkeys(["127.0.0.1", "localhost", *names]):
            try:
                alt.append(x509.IPAddress(ipaddress.ip_address(name)))
            except ValueError:
                alt.append(x509.DNSName(name))
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "elastic-run etcd")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=365))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            # Client auth too: a member of a served etcd presents it to the others (peer TLS).
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        cert_path = write_private_file(os.path.join(directory, "server.pem"),
                                       cert.public_bytes(serialization.Encoding.PEM))
        key_path = write_private_file(os.path.join(directory, "server.key"), key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        return ServerFiles(cert=cert_path, key=key_path)


def enable_auth(endpoint: str, js: Optional[JobSecret], ca_pem: bytes, *, root_password: Optional[str] = None,
                user: str = JOB_USER, password: Optional[str] = None, prefix: str = "/elastic/",
                timeout: float = 5.0) -> bool:
    """Create ``root`` and the job ``user`` (read/write on ``prefix`` only) and enable auth,
    over TLS, on an etcd nobody else can have reached yet (the embedded one: on loopback;
    Kubernetes' etcd: behind its NetworkPolicy). The passwords are ``js``'s, or given.
    An etcd whose auth is on already is left as it is (False). Whether it is on is asked of
    etcd (an anonymous read), never guessed from ``root`` existing: a first attempt that
    died after adding root once made every retry report "on already" while every key
    stayed open (security review 2, M1). Each step accepts what an earlier attempt did."""
    root_password = root_password or js.root_password
    password = password or js.password
    import grpc
    from etcd3 import etcdrpc
    from etcd3.etcdrpc import auth_pb2
    from etcd3.utils import prefix_range_end

    def done_before(call, request) -> None:
        try:
            call(request, timeout=timeout)
        except grpc.RpcError as exc:
            if "already" not in (exc.details() or ""):  # "user name already exists", "role ...", ...
                raise

    credentials = grpc.ssl_channel_credentials(root_certificates=ca_pem)
    with grpc.secure_channel(endpoint, credentials) as channel:
        try:
            etcdrpc.KVStub(channel).Range(etcdrpc.RangeRequest(key=b"\0", limit=1), timeout=timeout)
        except grpc.RpcError as exc:
            details = (exc.details() or "").lower()
            if exc.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED) or \
                    "user name is empty" in details or "token" in details:
                return False  # auth is on (a restart on the same data dir, a Job run before)
            raise
        auth = etcdrpc.AuthStub(channel)

        def our_user(name: str, secret: str) -> None:
            """Add it, or set our password on the one there: whoever added it before knows its own."""
            try:
                auth.UserAdd(etcdrpc.AuthUserAddRequest(name=name, password=secret), timeout=timeout)
            except grpc.RpcError as exc:
                if "already" not in (exc.details() or ""):
                    raise
                auth.UserChangePassword(etcdrpc.AuthUserChangePasswordRequest(name=name, password=secret),
                                        timeout=timeout)

        our_user(ROOT_USER, root_password)
        done_before(auth.RoleAdd, etcdrpc.AuthRoleAddRequest(name=ROOT_USER))
        done_before(auth.UserGrantRole, etcdrpc.AuthUserGrantRoleRequest(user=ROOT_USER, role=ROOT_USER))
        our_user(user, password)
        done_before(auth.RoleAdd, etcdrpc.AuthRoleAddRequest(name=JOB_ROLE))
        permission = auth_pb2.Permission(permType=auth_pb2.Permission.READWRITE, key=prefix.encode(),
                                               range_end=prefix_range_end(prefix.encode()))
        auth.RoleGrantPermission(etcdrpc.AuthRoleGrantPermissionRequest(name=JOB_ROLE, perm=permission),
                                 timeout=timeout)
        done_before(auth.UserGrantRole, etcdrpc.AuthUserGrantRoleRequest(user=user, role=JOB_ROLE))
        auth.AuthEnable(etcdrpc.AuthEnableRequest(), timeout=timeout)
    return True
