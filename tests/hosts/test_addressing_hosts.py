"""Several hosts (network namespaces on a bridge): the job forms its ring across them.

The host name resolves to 127.0.0.1 on every namespaced host, as on many real hosts
(127.0.1.1 on Debian), so these runs fail if gloo advertises the host name's address
instead of the one on the job's network.
"""

from __future__ import annotations

import subprocess

import pytest
import torch

from tests.fakes.jobs import TRAIN_JOB

pytestmark = pytest.mark.timeout(300)


def _finals(out):
    return [torch.load(p, weights_only=True) for p in sorted(out.glob("final-*.pt"))]


def _start(hosts, tmp_path, *, give_addr: bool, steps: int = 30, extra=(), env_of=None):
    """One agent per host; ``env_of``: host index -> extra environment of that agent."""
    jobs = []
    for host in hosts:
        launcher = ["--rdzv-endpoint", hosts.etcd_endpoint, "--job-id", "addressing",
                    "--np", "6", "--nproc-per-node", "2", "--host-id", host.name, *extra]
        if give_addr:
            launcher += ["--host-addr", host.addr]
        args = [*launcher, "--log-dir", str(tmp_path / host.name / "logs"), str(TRAIN_JOB),
                "--out", str(tmp_path / "out"), "--steps", str(steps)]
        jobs.append(host.job(tmp_path / host.name, args, name="agent", env=(env_of or {}).get(host.index)))
    return jobs


@pytest.mark.parametrize("give_addr", [
    pytest.param(True, id="host-addr-given", marks=pytest.mark.slow),  # the same path, with less to find out
    pytest.param(False, id="host-addr-default"),
])
def test_three_hosts_of_two_workers_train_to_the_end(netns_hosts, tmp_path, give_addr):
    hosts = netns_hosts(3)
    jobs = _start(hosts, tmp_path, give_addr=give_addr)
    for job in jobs:
        assert job.wait(240) == 0, job.text()[-3000:]
    params = _finals(tmp_path / "out")
    assert len(params) == 6
    for other in params[1:]:
        for name, value in params[0].items():
            assert torch.equal(value, other[name]), name
    for job, host in zip(jobs, hosts):
        started = [e for e in job.events() if e["event"] == "agent_started"]
        assert started, job.text()[-2000:]
        formed = [e["world_size"] for e in job.events() if e["event"] == "round_formed"]
        assert formed in ([], [6]), formed  # only the coordinator's agent logs rounds
        assert not [e for e in job.events() if e["event"] == "failure_detected"], job.text()[-2000:]


@pytest.mark.slow  # two failed rounds of a 10 s connect timeout, plus six worker starts each
def test_a_host_advertising_an_unreachable_address_fails_the_rounds_without_dropping_workers(netns_hosts, tmp_path):
    """Every host's gloo is told to use an interface whose address the other hosts have no
    route to (the user's GLOO_SOCKET_IFNAME wins): the trap of issue 8 in another form. (One
    such host alone may go unnoticed: gloo's pairs connect in one direction only.) Every
    round fails to connect: the agents say so in one line naming the addresses, keep all
    six workers (no "died" failure, no shrinking world) and, once --max-resets such rounds
    have failed, fail the job with that line."""
    hosts = netns_hosts(3)
    for host in hosts:
        for command in (["link", "add", "wrong0", "type", "veth", "peer", "name", "wrong1"],
                        ["addr", "add", f"10.99.0.{host.index + 1}/32", "dev", "wrong0"],
                        ["link", "set", "wrong0", "up"], ["link", "set", "wrong1", "up"]):
            subprocess.run(["ip", "-n", host.name, *command], check=True, timeout=30)
    extra = ["--max-resets", "1", "--collective-timeout", "10"]
    wrong = {"GLOO_SOCKET_IFNAME": "wrong0"}
    jobs = _start(hosts, tmp_path, give_addr=True, extra=extra, env_of={0: wrong, 1: wrong, 2: wrong})
    codes = [job.wait(240) for job in jobs]
    assert all(code != 0 for code in codes), codes
    addresses = ", ".join(sorted(host.addr for host in hosts))
    events = [e for job in jobs for e in job.events()]
    failures = [e for e in events if e["event"] == "failure_detected"]
    assert failures and all(e.get("network") for e in failures if e.get("rank") is None), failures
    assert not [e for e in failures if "died" in e["reason"]], failures
    assert all(f"could not connect to each other at {addresses}" in e["reason"] for e in failures), failures
    assert {e["world_size"] for e in events if e["event"] == "round_formed"} == {6}
    for job in jobs:
        text = job.text()
        # The failure to connect is one line wherever it is told, never a traceback.
        # (A worker still waiting to join when the job fails prints LeftJob's traceback:
        # the recovery path's, not this one's.)
        assert "PeersUnreachable" not in text, text[-3000:]
        # (torch's C++ logger adds its own "[E ... ProcessGroupGloo.cpp] connectFullMesh failed" line.)
        told = [line for line in text.splitlines() if ("connectFullMesh" in line or "could not connect" in line)
                and "ProcessGroupGloo.cpp" not in line]
        assert told and all("could not connect to each other" in line for line in told), told
        assert "job addressing failed: round" in text and addresses in text, text[-3000:]
