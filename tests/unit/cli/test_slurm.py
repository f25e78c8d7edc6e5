"""What elastic-run takes from Slurm's environment under srun, and that explicit options win."""

from __future__ import annotations

import os

import pytest

from elastic.cli import launch as cli
from elastic.cli import slurm
from elastic.cli.slurm import SlurmDefaults
from elastic.rendezvous import ConfigError

STEP = {"SLURM_JOB_ID": "4321", "SLURMD_NODENAME": "gpu08", "SLURM_JOB_NODELIST": "gpu[07-09]",
        "SLURM_STEP_TASKS_PER_NODE": "1(x3)", "SLURM_LOCALID": "0"}
PORT = slurm.RDZV_PORT_BASE + 4321 % slurm.RDZV_PORT_SPAN


@pytest.mark.parametrize("nodelist, first", [
    ("node1", "node1"),
    ("node1,node2", "node1"),
    ("gpu[07-09,12]", "gpu07"),
    ("gpu[007-009],cpu[1-2]", "gpu007"),
    ("rack[2-3]-n[05-06]", "rack2-n05"),
    ("a-b.c[3,1]", "a-b.c3"),
    (" x ", "x"),
])
def test_first_host_of_a_host_list(nodelist, first):
    assert slurm.first_host(nodelist) == first


@pytest.mark.parametrize("env, expected", [
    pytest.param({}, None, id="outside-slurm"),
    pytest.param({"SLURM_JOB_ID": "4321"}, None, id="salloc-shell-without-a-node"),
    pytest.param(STEP, SlurmDefaults("slurm-4321", "gpu08", None, f"gpu07:{PORT}", False), id="second-node"),
    pytest.param({**STEP, "SLURMD_NODENAME": "gpu07"},
                 SlurmDefaults("slurm-4321", "gpu07", None, f"gpu07:{PORT}", True), id="first-node-serves"),
    pytest.param({**STEP, "SLURM_GPUS_ON_NODE": "8", "SLURM_NTASKS_PER_NODE": "1"},
                 SlurmDefaults("slurm-4321", "gpu08", 8, f"gpu07:{PORT}", False), id="gpus-per-node"),
    pytest.param({**STEP, "SLURM_GPUS_ON_NODE": "0", "SLURM_NTASKS_PER_NODE": "4"},
                 SlurmDefaults("slurm-4321", "gpu08", 4, f"gpu07:{PORT}", False), id="tasks-per-node-of-the-job"),
    pytest.param({**STEP, "SLURM_RESTART_COUNT": "2"},
                 SlurmDefaults("slurm-4321-r2", "gpu08", None, f"gpu07:{PORT}", False), id="requeued"),
    pytest.param({**STEP, "SLURM_RESTART_COUNT": "0"},
                 SlurmDefaults("slurm-4321", "gpu08", None, f"gpu07:{PORT}", False), id="first-run"),
    pytest.param({**STEP, "SLURMD_NODENAME": "gpu07", "SLURM_STEP_TASKS_PER_NODE": "4(x3)", "SLURM_LOCALID": "2",
                  "SLURM_NTASKS_PER_NODE": "4"},
                 SlurmDefaults("slurm-4321", "gpu07-2", 1, f"gpu07:{PORT}", False), id="several-agents-per-node"),
    pytest.param({**STEP, "SLURM_JOB_NODELIST": ""},
                 SlurmDefaults("slurm-4321", "gpu08", None, f"gpu08:{PORT}", True), id="no-node-list"),
])
def test_defaults_from_the_environment(env, expected):
    assert slurm.defaults(env) == expected


def test_a_job_id_that_is_not_a_number_is_one_clear_error():
    with pytest.raises(ConfigError, match="SLURM_JOB_ID='x1'"):
        slurm.defaults({**STEP, "SLURM_JOB_ID": "x1"})


def _parse(tmp_path, monkeypatch, env, argv):
    for name in list(__import__("os").environ):
        if name.startswith(("SLURM", "ELASTIC_")):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    script = tmp_path / "train.py"
    script.write_text("")
    return cli.parse(["--np", "3", "--backend", "gloo", "--host-addr", "127.0.0.1", *argv, str(script)])


@pytest.mark.parametrize("env, argv, job_id, host_id, nproc, endpoint, rendezvous", [
    pytest.param(STEP, [], "slurm-4321", "gpu08", 1, f"gpu07:{PORT}", "reach", id="all-from-slurm"),
    pytest.param({**STEP, "SLURMD_NODENAME": "gpu07"}, [], "slurm-4321", "gpu07", 1, f"gpu07:{PORT}",
                 "serve", id="first-node"),
    pytest.param(STEP, ["--job-id", "mine", "--host-id", "h", "--nproc-per-node", "2", "--rdzv-endpoint", "e:1"],
                 "mine", "h", 2, "e:1", None, id="options-win"),
    pytest.param({**STEP, "ELASTIC_JOB_ID": "joined", "ELASTIC_RDZV_ENDPOINT": "etcd:2379"}, [],
                 "joined", "gpu08", 1, "etcd:2379", None, id="env-forms-win"),
    pytest.param({**STEP, "SLURMD_NODENAME": "gpu07", "ELASTIC_RDZV_ENDPOINT": "etcd:2379"}, [],
                 "slurm-4321", "gpu07", 1, "etcd:2379", None, id="external-etcd-nothing-served"),
    pytest.param({**STEP, "SLURM_GPUS_ON_NODE": "2"}, [], "slurm-4321", "gpu08", 2, f"gpu07:{PORT}", "reach",
                 id="gpus"),
])
def test_parse_fills_only_what_the_user_left_out(tmp_path, monkeypatch, env, argv, job_id, host_id, nproc, endpoint,
                                                 rendezvous):
    config, args = _parse(tmp_path, monkeypatch, env, argv)
    assert (config.job_id, config.host_id, config.nproc_per_node) == (job_id, host_id, nproc)
    assert (args.rdzv_endpoint, args.slurm_rendezvous) == (endpoint, rendezvous)
    if rendezvous is None:
        assert slurm.serve_rendezvous(args) is None  # the user's etcd: nothing started, nothing waited for


def test_outside_slurm_nothing_changes(tmp_path, monkeypatch):
    config, args = _parse(tmp_path, monkeypatch, {}, [])
    assert config.job_id == "local" and args.rdzv_endpoint is None and not hasattr(args, "slurm_rendezvous")
    assert slurm.serve_rendezvous(args) is None


def test_the_jobs_embedded_etcd_comes_back_after_the_steps_sigterm_with_its_data(tmp_path):
    """Slurm's SIGTERM reaches the etcd the first node serves: it starts again on its data and port."""
    import os
    import signal
    import time

    from elastic.rendezvous import Etcd
    from tests.conftest import etcd_binary_or_skip

    etcd = slurm._StepEtcd(binary=etcd_binary_or_skip(), port=slurm.RDZV_PORT_BASE + os.getpid() % 1000)
    etcd.start()
    try:
        etcd.keep_up()
        client = Etcd(etcd.config(retry_deadline=30.0))
        client.put("/kept", b"yes")
        first = etcd.pid
        os.kill(first, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while (etcd.pid == first or not etcd.running) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert etcd.pid != first and etcd.running
        assert client.get("/kept").value == b"yes"  # same data, same endpoint
        client.close()
    finally:
        etcd.stop()
    time.sleep(0.5)
    assert not etcd.running  # stop() is final: the keeper does not start it again


def test_a_first_node_whose_etcd_never_listens_is_one_clear_error():
    import socket

    from elastic.rendezvous import RendezvousError

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(RendezvousError, match=rf"embedded etcd at 127.0.0.1:{port} \(first node of the allocation\) "
                                              r"did not answer within 0.3s"):
        slurm._wait_for_listener("127.0.0.1", port, 0.3)


def test_a_requeued_run_takes_its_checkpoint_directory_over(tmp_path, monkeypatch):
    """A requeued run has its own job id (slurm-<id>-r<N>) and resumes the first run's
    checkpoints: it takes the directory's claim over (checkpoint/owner.py)."""
    from elastic.checkpoint import owner

    ckpt = tmp_path / "ckpt"
    config, _ = _parse(tmp_path, monkeypatch, STEP, ["--checkpoint-dir", str(ckpt)])
    assert owner.owner_of(str(ckpt)) == config.job_id == "slurm-4321"
    config, _ = _parse(tmp_path, monkeypatch, {**STEP, "SLURM_RESTART_COUNT": "1"}, ["--checkpoint-dir", str(ckpt)])
    assert owner.owner_of(str(ckpt)) == config.job_id == "slurm-4321-r1"
    with pytest.raises(ConfigError, match="belongs to job 'slurm-4321-r1'"):  # another job is still refused
        _parse(tmp_path, monkeypatch, {**STEP, "SLURM_JOB_ID": "999"}, ["--checkpoint-dir", str(ckpt)])


def test_two_allocations_resuming_one_job_id_never_share_or_delete_each_others_secret(tmp_path):
    # Security review 2, L1: both wrote ~/.elastic-run/secrets/<job-id>.secret; when the
    # first ended (or was SIGKILLed: its reaper removes by path), the second's was gone.
    from elastic.cli.slurm import _StepEtcd, default_secret_file
    from elastic.rendezvous.errors import ConfigError
    from elastic.rendezvous.job_secret import new_secret, write_secret_file
    home = {"ELASTIC_JOB_SECRET_DIR": str(tmp_path)}
    first = default_secret_file({**home, "SLURM_JOB_ID": "101"}, "resume-me")
    second = default_secret_file({**home, "SLURM_JOB_ID": "202"}, "resume-me")
    requeued = default_secret_file({**home, "SLURM_JOB_ID": "101", "SLURM_RESTART_COUNT": "1"}, "resume-me")
    assert len({first, second, requeued}) == 3 and all("resume-me" in p for p in (first, second, requeued))
    write_secret_file(first, new_secret(), exclusive=True)
    with pytest.raises(ConfigError, match="exists already"):  # never written over, whoever wrote it
        write_secret_file(first, new_secret(), exclusive=True)
    # An etcd stops and removes the file it wrote, and only that one: not a file put there since.
    from elastic.cli.slurm import _digest
    etcd = _StepEtcd()
    etcd.generated_secret = (first, _digest(first))
    os.unlink(first)
    write_secret_file(first, new_secret())
    etcd.stop()
    assert os.path.exists(first)
    etcd.generated_secret = (first, _digest(first))
    etcd.stop()
    assert not os.path.exists(first)
