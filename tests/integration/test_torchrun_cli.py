"""torchrun's documented multi-node command, with `elastic-run` for `torchrun`: two agents
on this host (loopback), a real etcd at the endpoint, a torchrun-style script trained to the end."""

from __future__ import annotations

import json
import re
import shlex
import socket
import uuid

import pytest

from tests.fakes.jobs import REPO, Job, read_jsonl, wait_until

pytestmark = pytest.mark.timeout(300)

SCRIPT = REPO / "examples" / "torchrun_style.py"


def test_torchruns_multinode_command_trains_a_torchrun_script(tmp_path, etcd_server):
    out, snapshot = tmp_path / "result.json", tmp_path / "snapshot.pt"
    # torchrun's spellings only, as a torchrun user types them on every node (the endpoint
    # is an etcd v3 here; last_call_timeout: the first round waits for the second node).
    command = ["--nnodes=1:2", "--nproc_per_node=2", "--max-restarts=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint={etcd_server.endpoint}", f"--rdzv-id=torchrun-{uuid.uuid4().hex[:8]}",
               "--rdzv-conf=last_call_timeout=120,read_timeout=60", "--monitor-interval=1", "--tee=3"]
    script = [str(SCRIPT), "--steps", "40", "--snapshot", str(snapshot), "--out", str(out)]
    names = ("node0", "node1")
    nodes = [Job(tmp_path, [*command, "--log_dir", str(tmp_path / f"logs-{name}"), *script], name=name)
             for name in names]
    for node in nodes:
        assert node.wait(240) == 0, node.text()[-3000:]
    result = json.loads(out.read_text())
    assert result["step"] == 40
    assert result["world_size"] == 4  # --nnodes 1:2 x --nproc-per-node 2: both nodes, two workers each
    for name, node in zip(names, nodes):
        events = read_jsonl(tmp_path / f"logs-{name}" / "events.jsonl")
        started = [e for e in events if e["event"] == "worker_started"]
        assert len(started) == 2, node.text()[-3000:]
        rounds = [e for e in events if e["event"] == "round_started"]
        assert [e["world_size"] for e in rounds] == [4]  # one round: the last call waited for node1
        # the options with no effect say so, in one line each
        assert "--monitor-interval has no effect here" in node.text()


def test_the_printed_join_command_works_as_printed(tmp_path):
    out = tmp_path / "result.json"
    first = Job(tmp_path, ["--min-np", "2", "--max-np", "2", "--nproc-per-node", "1",
                           "--log-dir", str(tmp_path / "logs"), str(SCRIPT), "--steps", "20", "--out", str(out)],
                name="first")
    found = wait_until(lambda: re.search(r"join with: (elastic-run .*?)(?: \(|;|$)", first.text(), re.M), 120,
                       "the join hint")
    words = shlex.split(found.group(1))
    assert words[0] == "elastic-run" and "..." not in words
    joiner = Job(tmp_path, words[1:], name="joiner")  # from another directory: cwd is the repository
    assert first.wait(240) == 0, first.text()[-3000:]
    assert joiner.wait(60) == 0, joiner.text()[-3000:]
    assert json.loads(out.read_text()) == {**json.loads(out.read_text()), "step": 20, "world_size": 2}
    assert "works from this machine only" in first.text()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_torchruns_single_host_c10d_command_serves_its_loopback_endpoint(tmp_path):
    """torchrun's documented single-host elastic command, `torchrun` -> `elastic-run` and a
    free port: nothing listens at localhost:PORT, so the first agent serves the rendezvous
    there (as torchrun's c10d store), and a second agent typing the same command joins it."""
    out = tmp_path / "result.json"
    command = ["--nnodes=1:2", "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{_free_port()}",
               str(SCRIPT), "--steps", "20", "--out", str(out)]
    first = Job(tmp_path, command, name="first")
    wait_until(lambda: "serving the rendezvous at localhost" in first.text(), 60, "the first agent to serve")
    second = Job(tmp_path, command, name="second")
    assert first.wait(240) == 0, first.text()[-3000:]
    assert second.wait(60) == 0, second.text()[-3000:]
    result = json.loads(out.read_text())
    assert (result["step"], result["world_size"]) == (20, 4)  # both agents' workers in one round
    assert "waiting up to" in second.text() and "serving" not in second.text()
    for agent in (first, second):
        assert "etcd" not in agent.text().split("summary:")[0].lower().replace("embedded etcd", ""), agent.text()
