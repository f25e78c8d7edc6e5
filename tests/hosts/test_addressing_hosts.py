"""Several hosts (network namespaces on a bridge): the job forms its ring across them.

The host name resolves to 127.0.0.1 on every namespaced host, as on many real hosts
(127.0.1.1 on Debian), so these runs fail if gloo advertises the host name's address
instead of the one on the job's network.
"""

from __future__ import annotations

import pytest
import torch

from tests.fakes.jobs import TRAIN_JOB

pytestmark = pytest.mark.timeout(300)


def _finals(out):
    return [torch.load(p, weights_only=True) for p in sorted(out.glob("final-*.pt"))]


def _start(hosts, tmp_path, *, give_addr: bool, steps: int = 30, extra=()):
    jobs = []
    for host in hosts:
        launcher = ["--rdzv-endpoint", hosts.etcd_endpoint, "--job-id", "addressing",
                    "--np", "6", "--nproc-per-node", "2", "--host-id", host.name, *extra]
        if give_addr:
            launcher += ["--host-addr", host.addr]
        args = [*launcher, "--log-dir", str(tmp_path / host.name / "logs"), str(TRAIN_JOB),
                "--out", str(tmp_path / "out"), "--steps", str(steps)]
        jobs.append(host.job(tmp_path / host.name, args, name="agent"))
    return jobs


@pytest.mark.parametrize("give_addr", [True, False], ids=["host-addr-given", "host-addr-default"])
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
