"""The job's own etcd from a per-job secret (rendezvous/job_secret.py): TLS and auth on a real etcd.

A client with the secret (its CA and password derived anew, as on another host) reads and
writes; strangers (plaintext, the CA without the password, another job's secret) can do
neither; a squatter on the port, started with another secret, is refused in one line, by
the agent (ELASTIC_JOB_SECRET with --rdzv-endpoint) and by Slurm's other nodes.
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from elastic.cli import launch, slurm
from elastic.cli.options import etcd_config
from elastic.rendezvous import EmbeddedEtcd, Etcd, EtcdConfig, RendezvousAuthError, RendezvousError
from elastic.rendezvous.job_secret import JobSecret, new_secret, write_secret_file
from tests.fakes.jobs import ELASTIC_RUN, REPO

from ..conftest import etcd_binary_or_skip


@pytest.fixture(scope="module")
def job_etcd():
    secret = new_secret()
    server = EmbeddedEtcd(binary=etcd_binary_or_skip(), security=JobSecret(secret)).start()
    yield server, secret
    server.stop()


def _client(server, directory, secret, **overrides) -> Etcd:
    js = JobSecret(secret)  # derived anew: what another host of the job has
    files = js.client_files(str(directory))
    options = dict(ca_cert=files.ca_cert, user=files.user, password=js.password, retry_deadline=1.0)
    options.update(overrides)
    return Etcd(EtcdConfig(endpoints=((server.host, server.client_port),), **options))


def test_a_client_with_the_secret_reads_and_writes_the_job_prefix_only(job_etcd, tmp_path):
    server, secret = job_etcd
    with _client(server, tmp_path, secret) as client:
        client.check()
        client.put("/elastic/j/k", b"v")
        assert client.get("/elastic/j/k").value == b"v"
        with pytest.raises(RendezvousAuthError, match="permission denied"):
            client.put("/elsewhere", b"v")


@pytest.mark.parametrize("stranger", ["plaintext", "ca-without-password", "wrong-password", "another-secret"])
def test_a_stranger_without_the_secret_can_neither_read_nor_write(job_etcd, tmp_path, stranger):
    server, secret = job_etcd
    with _client(server, tmp_path, secret) as owner:
        owner.put("/elastic/j/mine", b"v")
    overrides = {
        "plaintext": dict(ca_cert=None, user=None, password=None),
        "ca-without-password": dict(user=None, password=None),
        "wrong-password": dict(password="guess"),
        "another-secret": {},
    }[stranger]
    with _client(server, tmp_path, new_secret() if stranger == "another-secret" else secret, **overrides) as client:
        for attempt in (lambda: client.get("/elastic/j/mine"), lambda: client.put("/elastic/j/mine", b"evil")):
            with pytest.raises(RendezvousError):
                attempt()
    with _client(server, tmp_path, secret) as owner:
        assert owner.get("/elastic/j/mine").value == b"v"


@pytest.fixture
def squatter():
    server = EmbeddedEtcd(binary=etcd_binary_or_skip(), security=JobSecret(new_secret())).start()
    yield server
    server.stop()


def test_the_agent_refuses_a_squatter_in_one_line(squatter, tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "ELASTIC_JOB_SECRET": new_secret()}
    result = subprocess.run([*ELASTIC_RUN, "--rdzv-endpoint", squatter.endpoint, "--job-id", "j", "--np", "1",
                             "--host-addr", "127.0.0.1", "--backend", "gloo", str(REPO / "tests/fakes/train_job.py")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("elastic-run:")]
    assert len(lines) == 1 and "does not verify against our CA" in lines[0], result.stderr


def _slurm_args(tmp_path, monkeypatch, node: str, job: int):
    for name in list(__import__("os").environ):
        if name.startswith(("SLURM", "ELASTIC_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_JOB_ID", str(job))
    monkeypatch.setenv("SLURMD_NODENAME", node)
    monkeypatch.setenv("SLURM_JOB_NODELIST", "localhost")
    monkeypatch.setenv("ELASTIC_JOB_SECRET_DIR", str(tmp_path / "secrets"))
    script = tmp_path / "train.py"
    script.write_text("")
    return launch.parse(["--np", "2", "--backend", "gloo", "--host-addr", "127.0.0.1", str(script)])[1]


def test_slurms_first_node_serves_with_a_generated_secret_and_the_others_reach_it(tmp_path, monkeypatch):
    job = random.randrange(1, 10**6)
    served = slurm.serve_rendezvous(_slurm_args(tmp_path, monkeypatch, "localhost", job))
    try:
        secret_file = tmp_path / "secrets" / f"slurm-{job}.secret"
        assert secret_file.stat().st_mode & 0o777 == 0o600
        reach = _slurm_args(tmp_path, monkeypatch, "other", job)
        assert slurm.serve_rendezvous(reach) is None  # listens, and holds the job's certificate
        with Etcd(etcd_config(reach)) as client:
            client.put(f"/elastic/slurm-{job}/k", b"v")
        with Etcd(EtcdConfig.from_string(reach.rdzv_endpoint, retry_deadline=1.0)) as stranger:
            with pytest.raises(RendezvousError):
                stranger.get(f"/elastic/slurm-{job}/k")
    finally:
        served.stop()
    assert not secret_file.exists()


def test_slurms_other_nodes_refuse_a_squatter_on_the_port_in_one_line(tmp_path, monkeypatch):
    job = random.randrange(1, 10**6)
    port = slurm.RDZV_PORT_BASE + job % slurm.RDZV_PORT_SPAN
    squatter = EmbeddedEtcd(binary=etcd_binary_or_skip(), port=port, security=JobSecret(new_secret())).start()
    try:
        (tmp_path / "secrets").mkdir(mode=0o700)
        write_secret_file(str(tmp_path / "secrets" / f"slurm-{job}.secret"), new_secret())
        reach = _slurm_args(tmp_path, monkeypatch, "other", job)
        with pytest.raises(RendezvousError, match="is not this job's etcd, refused: etcd's certificate does not "
                                                  "verify against our CA") as refused:
            slurm.serve_rendezvous(reach)
        assert "\n" not in str(refused.value)
    finally:
        squatter.stop()


ENVIRON_PROBE = '''
import json, os, runpy, subprocess, sys
child = subprocess.run(["cat", "/proc/self/environ"], capture_output=True).stdout
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"self": open("/proc/self/environ", "rb").read().decode("latin-1"),
                        "child": child.decode("latin-1")}) + "\\n")
sys.argv = [sys.argv[2], *sys.argv[3:]]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def test_workers_log_in_from_a_0600_file_and_never_see_the_password_in_their_environment(job_etcd, tmp_path):
    server, secret = job_etcd
    probe, seen = tmp_path / "probe.py", tmp_path / "environ.jsonl"
    probe.write_text(ENVIRON_PROBE)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "ELASTIC_JOB_SECRET": secret,
           "ELASTIC_ETCD_PASSWORD": "env-s3cret"}  # ignored for the job secret's, and never passed on
    result = subprocess.run([*ELASTIC_RUN, "--rdzv-endpoint", server.endpoint, "--job-id", "environ", "--np", "1",
                             "--host-addr", "127.0.0.1", "--backend", "gloo", str(probe), str(seen),
                             str(REPO / "tests/fakes/train_job.py"), "--steps", "3", "--out", str(tmp_path / "out")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]  # the worker logged in with the file's password
    (record,) = [__import__("json").loads(line) for line in seen.read_text().splitlines()]
    for environ in (record["self"], record["child"]):
        assert "ELASTIC_WORKER_ETCD_PASSWORD_FILE=" in environ  # what it gets instead
        for leaked in (JobSecret(secret).password, secret, "env-s3cret"):
            assert leaked not in environ


def test_the_kubernetes_auth_job_enables_auth_once_and_again_harmlessly(tmp_path, capsys):
    """python -m elastic.cli.etcd_auth, as deploy/workers/etcd-auth-job.yaml runs it, on a TLS etcd without auth."""
    from elastic.cli import etcd_auth
    from elastic.rendezvous.job_secret import write_private_file

    secret = new_secret()
    js = JobSecret(secret)
    server_files = js.server_files(str(tmp_path), ["127.0.0.1"])
    files = js.client_files(str(tmp_path))
    root = write_private_file(str(tmp_path / "root-password"), b"r00t")
    server = EmbeddedEtcd(binary=etcd_binary_or_skip(), scheme="https", client_options={"ca_cert": files.ca_cert},
                          extra_args=["--cert-file", server_files.cert, "--key-file", server_files.key]).start()
    try:
        argv = ["--endpoint", f"https://{server.endpoint}", "--ca", files.ca_cert, "--root-password-file", root,
                "--password-file", files.password_file, "--wait", "5"]
        assert etcd_auth.main(argv) == 0 and etcd_auth.main(argv) == 0
        assert capsys.readouterr().out.splitlines() == [f"etcd_auth: auth enabled at {server.endpoint}",
                                                         f"etcd_auth: auth was on already at {server.endpoint}"]
        with _client(server, tmp_path, secret) as client:
            client.put("/elastic/k", b"v")
        with _client(server, tmp_path, secret, password=None, user=None) as stranger:
            with pytest.raises(RendezvousAuthError):
                stranger.put("/elastic/k", b"evil")
    finally:
        server.stop()


def _listening(pid: int) -> list[tuple[str, int]]:
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        if f"pid={pid}," in line:
            address, port = line.split()[3].rsplit(":", 1)
            found.append((address.strip("[]"), int(port)))
    return found


def test_slurms_secured_etcd_keeps_raft_on_loopback_behind_tls_and_client_certificates(tmp_path):
    # Security review 2, H1: the secured embedded etcd served raft in plain HTTP, without
    # authentication, on the node's address: a stranger read /members and one forged
    # heartbeat panicked etcd (47 of 48 authenticated writes failed at two a second).
    import socket
    import ssl
    import urllib.request

    etcd_binary_or_skip()
    address = "127.0.0.2"  # the node's routable address, as far as this test is concerned
    server = slurm._StepEtcd(host=address, security=JobSecret(new_secret()), binary=etcd_binary_or_skip()).start()
    try:
        listening = _listening(server.pid)
        off_loopback = [(a, p) for a, p in listening if a != "127.0.0.1"]
        assert off_loopback == [(address, server.client_port)], listening  # the clients' port only
        assert ("127.0.0.1", server.peer_port) in listening
        # The peer port speaks TLS and wants a certificate of the job's CA: plain HTTP and a
        # TLS client without one both get nothing.
        with pytest.raises(Exception):
            urllib.request.urlopen(f"http://127.0.0.1:{server.peer_port}/members", timeout=5).read()
        context = ssl.create_default_context(cafile=server.client_files.ca_cert)
        context.check_hostname = False
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            with socket.create_connection(("127.0.0.1", server.peer_port), timeout=5) as raw:
                with context.wrap_socket(raw) as tls:
                    tls.sendall(b"GET /members HTTP/1.1\r\nHost: x\r\n\r\n")
                    if not tls.recv(1):
                        raise ConnectionError("closed")
        with Etcd(server.config()) as client:  # and the job's own clients still work
            client.put("/elastic/h1", b"ok")
            assert client.get("/elastic/h1").value == b"ok"
    finally:
        server.stop()


def test_the_auth_job_enables_auth_whatever_a_first_attempt_left_and_clients_refuse_auth_off(tmp_path):
    # Security review 2, M1: a first run of the etcd-auth Job that died after adding root made
    # every retry print "auth was on already" and exit 0, while every key stayed open and the
    # workers' password was silently ignored.
    import grpc
    from etcd3 import etcdrpc

    from elastic.rendezvous.job_secret import write_private_file
    js = JobSecret(new_secret())
    files = js.client_files(str(tmp_path))
    server_files = js.server_files(str(tmp_path), ["127.0.0.1"])
    server = EmbeddedEtcd(binary=etcd_binary_or_skip(), scheme="https",
                          extra_args=["--cert-file", server_files.cert, "--key-file", server_files.key],
                          client_options={"ca_cert": files.ca_cert}).start()
    try:
        endpoint = f"127.0.0.1:{server.client_port}"
        # Auth off: a client given a user refuses it (unless allowed), instead of ignoring the user.
        options = dict(ca_cert=files.ca_cert, user="elastic", password=js.password, retry_deadline=1.0)
        with pytest.raises(RendezvousAuthError, match="auth disabled although a user is configured"):
            with Etcd(EtcdConfig(endpoints=(("127.0.0.1", server.client_port),), require_auth=True, **options)) as c:
                c.get("/elastic/x")
        # What a first attempt left (or a stranger who got there first): root, with its password.
        with grpc.secure_channel(endpoint, grpc.ssl_channel_credentials(js.ca_pem())) as channel:
            etcdrpc.AuthStub(channel).UserAdd(etcdrpc.AuthUserAddRequest(name="root", password="strangers"), timeout=5)
        root_file = write_private_file(str(tmp_path / "root-password"), b"the-jobs-root-password")
        command = [sys.executable, "-m", "elastic.cli.etcd_auth", "--endpoint", f"https://{endpoint}",
                   "--ca", files.ca_cert, "--root-password-file", root_file, "--password-file", files.password_file]
        for expected in ("auth enabled", "auth was on already"):  # the retry, then a run once done
            run = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=str(REPO))
            assert run.returncode == 0 and expected in run.stdout, (run.stdout, run.stderr)
        anonymous = EtcdConfig(endpoints=(("127.0.0.1", server.client_port),), ca_cert=files.ca_cert,
                               retry_deadline=1.0)
        with pytest.raises(RendezvousError):
            with Etcd(anonymous) as c:
                c.put("/elastic/open", b"1")
        with pytest.raises(RendezvousAuthError):  # the stranger's root password is no longer root's
            with Etcd(EtcdConfig(endpoints=(("127.0.0.1", server.client_port),), ca_cert=files.ca_cert,
                                 user="root", password="strangers", retry_deadline=1.0)) as c:
                c.get("/elastic/x")
        with Etcd(EtcdConfig(endpoints=(("127.0.0.1", server.client_port),), require_auth=True, **options)) as c:
            c.put("/elastic/ok", b"1")
    finally:
        server.stop()
