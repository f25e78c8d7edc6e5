"""TLS with client certificates, and etcd user authentication, against real etcd servers."""

from __future__ import annotations

import time

import grpc
import pytest
from etcd3 import etcdrpc

from elastic.rendezvous.embedded import EmbeddedEtcd
from elastic.rendezvous.errors import RendezvousAuthError, RendezvousConnectionError
from elastic.rendezvous.etcd import Etcd
from tests.fakes.pki import make_pki, tls_etcd_server

from ..conftest import etcd_binary_or_skip

pytestmark = pytest.mark.timeout(60)


# ----------------------------------------------------------------------------- a throw-away PKI


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_etcd(pki):
    server = tls_etcd_server(etcd_binary_or_skip(), pki).start()
    yield server
    server.stop()


# ----------------------------------------------------------------------------- TLS


def test_tls_client_with_certificate_works(tls_etcd):
    with Etcd(tls_etcd.config()) as client:
        client.check()
        revision = client.put("/tls/k", b"secret")
        assert client.get("/tls/k").mod_revision == revision


def test_tls_client_without_certificate_is_refused_clearly(tls_etcd):
    with Etcd(tls_etcd.config(cert_cert=None, cert_key=None, retry_deadline=5.0)) as client:
        started = time.monotonic()
        # An auth error, not a connection error: it is not retried, and it says why.
        with pytest.raises(RendezvousAuthError) as info:
            client.check(timeout=5.0)
    message = str(info.value)
    assert time.monotonic() - started < 4.0  # not retried until its 5 s retry deadline
    assert tls_etcd.endpoint in message and "\n" not in message
    assert "client certificate" in message, message


def test_a_stopped_tls_etcd_is_unreachable_not_a_certificate_problem(pki, tmp_path):
    # The probe that tells certificate refusals apart must not call an outage one.
    server = tls_etcd_server(etcd_binary_or_skip(), pki).start()
    config = server.config(retry_deadline=1.5)
    server.stop()
    with Etcd(config) as client:
        with pytest.raises(RendezvousConnectionError, match="cannot reach etcd"):
            client.check(timeout=1.5)


def test_tls_client_with_the_wrong_ca_is_refused_clearly(tls_etcd, pki):
    # The client certificate is not a CA: the server's certificate cannot verify against it.
    with Etcd(tls_etcd.config(ca_cert=pki["client_cert"], cert_cert=None, cert_key=None)) as client:
        with pytest.raises(RendezvousAuthError, match="does not verify against our CA"):
            client.check()


# ----------------------------------------------------------------------------- user auth


@pytest.fixture(scope="module")
def auth_etcd():
    """An etcd with auth enabled and user root / s3cret (set up through the gRPC auth API)."""
    server = EmbeddedEtcd(binary=etcd_binary_or_skip()).start()
    channel = grpc.insecure_channel(server.endpoint)
    auth = etcdrpc.AuthStub(channel)
    auth.UserAdd(etcdrpc.AuthUserAddRequest(name="root", password="s3cret"), timeout=5)
    auth.RoleAdd(etcdrpc.AuthRoleAddRequest(name="root"), timeout=5)
    auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=5)
    auth.AuthEnable(etcdrpc.AuthEnableRequest(), timeout=5)
    channel.close()
    yield server
    server.stop()


def test_auth_with_the_right_password_works(auth_etcd):
    with Etcd(auth_etcd.config(user="root", password="s3cret")) as client:
        client.check()
        client.put("/auth/k", b"v")
        assert client.get("/auth/k").value == b"v"


def test_wrong_password_fails_fast_and_says_so(auth_etcd):
    with Etcd(auth_etcd.config(user="root", password="wrong")) as client:
        started = time.monotonic()
        with pytest.raises(RendezvousAuthError) as info:
            client.put("/auth/k", b"v")
        assert time.monotonic() - started < 5.0  # not retried for retry_deadline (30 s)
        assert client.requests == 1
    assert str(info.value) == f"etcd at {auth_etcd.endpoint} rejected user 'root': wrong user name or password"


def test_missing_credentials_are_reported(auth_etcd):
    with Etcd(auth_etcd.config()) as client:
        with pytest.raises(RendezvousAuthError, match="requires authentication: configure a user and password"):
            client.check()
        with pytest.raises(RendezvousAuthError, match="requires authentication"):
            client.get("/auth/k")


def test_auth_survives_an_etcd_restart(auth_etcd, job_prefix):
    """The token is re-fetched if the restarted etcd no longer knows it."""
    with Etcd(auth_etcd.config(user="root", password="s3cret")) as client:
        client.put(job_prefix + "k", b"before")
        auth_etcd.kill()
        auth_etcd.restart()
        assert client.get(job_prefix + "k").value == b"before"
        client.put(job_prefix + "k", b"after")


def test_a_stale_token_is_replaced_transparently(auth_etcd, job_prefix):
    """etcd forgets simple tokens (TTL, or a restart from a snapshot): the client logs in again."""
    with Etcd(auth_etcd.config(user="root", password="s3cret")) as client:
        client.put(job_prefix + "k", b"1")
        client._token = "stale.token"  # what a forgotten token looks like to etcd
        assert client.get(job_prefix + "k").value == b"1"
        assert client._token not in (None, "stale.token")


def test_a_watch_whose_token_died_logs_in_again_on_its_own(auth_etcd, job_prefix):
    """A restarted etcd answers a watch opened with a forgotten token with a cancellation
    ("invalid auth token"; etcd 3.5.1 says "permission denied"), not an error. The watch
    must log in again itself: its client may make no other call for a long time (a Slurm
    job's agents once re-watched with the dead token for 13 s, 628 times, and missed the
    request that should have stopped the job)."""
    import threading

    with Etcd(auth_etcd.config(user="root", password="s3cret")) as client, \
            Etcd(auth_etcd.config(user="root", password="s3cret")) as writer:
        revision = client.put(job_prefix + "k", b"before")  # logged in
        client._token = "stale.token"  # what a token looks like to an etcd that forgot it
        seen = threading.Event()
        watch = client.watch(job_prefix, prefix=True, start_revision=revision + 1,
                             on_events=lambda events: seen.set() if any(e.kv.value == b"after" for e in events)
                             else None)
        writer.put(job_prefix + "k", b"after")
        assert seen.wait(10), f"the watch saw nothing ({watch.reconnects} reconnects)"
        assert watch.reconnects <= 3
