"""torchrun's spellings under elastic-run: every option of the installed torch's parser is
in the table, and a table of command lines and what they become (or why refused)."""

from __future__ import annotations

import re

import pytest
from torch.distributed.run import get_args_parser

from tests.fakes.jobs import REPO

from elastic.cli import torchrun
from elastic.cli.join_hint import join_hint
from elastic.cli.launch import build_parser, main, parse
from elastic.rendezvous import ConfigError, RendezvousSettings

VALUE_FLAGS = torchrun.value_flags(build_parser())
DEVICES = lambda: torchrun.Devices(gpus=8, cpus=32)  # noqa: E731
NO_GPU = lambda: torchrun.Devices(gpus=0, cpus=4)  # noqa: E731
TORCH_OPTIONS = [a for a in get_args_parser()._actions if a.option_strings]


def test_every_option_of_the_installed_torchrun_is_translated_or_refused():
    # A torch that adds an option fails here until the table says what it becomes.
    missing = [s for a in TORCH_OPTIONS for s in a.option_strings if s not in torchrun.SPELLINGS]
    assert not missing, f"torchrun options not in elastic/cli/torchrun.py's TABLE: {missing}"
    for action in TORCH_OPTIONS:
        key = {torchrun.SPELLINGS[s] for s in action.option_strings}
        assert len(key) == 1, action.option_strings  # one row per option, all its spellings
        assert (action.nargs != 0) == (key.pop() in torchrun.TAKES_VALUE), action.option_strings
    # ...and no row for an option torch no longer has.
    spellings = {s for a in TORCH_OPTIONS for s in a.option_strings}
    assert set(torchrun.SPELLINGS) <= spellings


def test_the_docs_table_is_the_table():
    text = (REPO / "docs" / "torchrun.md").read_text()
    assert torchrun.markdown_table() in text, "regenerate: python -c 'from elastic.cli import torchrun; " \
                                              "print(torchrun.markdown_table())' and paste into docs/torchrun.md"


TRANSLATED = [
    # (torchrun-style argv, elastic-run argv)
    # torchrun's documented multi-node command: hosts become workers
    (["--nnodes=2:8", "--nproc-per-node=8", "--max-restarts=3", "--rdzv-id=job42", "--rdzv-backend=c10d",
      "--rdzv-endpoint=node0:29400", "train.py"],
     ["--nproc-per-node", "8", "--min-np", "16", "--max-np", "64", "--rdzv-settle", "30",
      "--rdzv-endpoint", "node0:29400", "--job-id", "job42", "--rdzv-backend", "c10d", "--max-restarts", "3",
      "train.py"]),
    # torchrun's single-host elastic spelling: the loopback endpoint is served (c10d), the id is torchrun's default
    (["--nnodes=1:2", "--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:29400", "train.py"],
     ["--nproc-per-node", "2", "--min-np", "2", "--max-np", "4", "--rdzv-settle", "30",
      "--rdzv-endpoint", "localhost:29400", "--rdzv-backend", "c10d", "--job-id", "none", "train.py"]),
    # torchrun's last call given: no default settle
    (["--nnodes=1:2", "--rdzv-conf=last_call_timeout=5", "t.py"],
     ["--min-np", "1", "--max-np", "2", "--rdzv-settle", "5", "t.py"]),
    (["--nnodes=1:2", "--rdzv-settle", "2", "t.py"], ["--min-np", "1", "--max-np", "2", "--rdzv-settle", "2", "t.py"]),
    (["--nnodes", "2", "--nproc_per_node", "4", "t.py"], ["--nproc-per-node", "4", "--np", "8", "t.py"]),
    (["--nnodes", "1:3", "t.py"], ["--min-np", "1", "--max-np", "3", "--rdzv-settle", "30", "t.py"]),
    # torchrun's default --nnodes 1:1
    (["--nproc-per-node", "2", "t.py"], ["--nproc-per-node", "2", "--np", "2", "t.py"]),
    (["--nproc-per-node", "2", "--max-np", "4", "t.py"], ["--nproc-per-node", "2", "--max-np", "4", "t.py"]),
    (["--nproc-per-node", "2", "-np", "4", "t.py"], ["--nproc-per-node", "2", "-np", "4", "t.py"]),
    (["--nproc-per-node", "gpu", "t.py"], ["--nproc-per-node", "8", "--np", "8", "t.py"]),
    (["--nproc-per-node", "auto", "t.py"], ["--nproc-per-node", "8", "--np", "8", "t.py"]),
    (["--nproc-per-node", "cpu", "t.py"], ["--nproc-per-node", "32", "--np", "32", "t.py"]),
    # the backends all mean an etcd v3 at the endpoint; a missing port is the backend's default
    (["--rdzv_backend", "static", "--rdzv_endpoint", "h1", "--rdzv_id", "j", "--np", "2", "t.py"],
     ["--rdzv-endpoint", "h1:29400", "--job-id", "j", "--rdzv-backend", "c10d", "--np", "2", "t.py"]),
    (["--rdzv-backend=etcd-v2", "--rdzv-endpoint=e1,e2:2380", "--rdzv-id=j", "--np", "2", "t.py"],
     ["--rdzv-endpoint", "e1:2379,e2:2380", "--job-id", "j", "--np", "2", "t.py"]),
    (["--rdzv-backend", "etcd", "--rdzv-endpoint", "https://[::1]:2379", "--job-id", "j", "--np", "1", "t.py"],
     ["--rdzv-endpoint", "https://[::1]:2379", "--job-id", "j", "--np", "1", "t.py"]),
    # elastic-run's own command lines are unchanged
    (["--rdzv-endpoint", "10.0.0.5:2379", "--job-id", "j", "--np", "2", "t.py"],
     ["--rdzv-endpoint", "10.0.0.5:2379", "--job-id", "j", "--np", "2", "t.py"]),
    (["--log-dir", "--nnodes", "--np", "2", "t.py"], ["--log-dir", "--nnodes", "--np", "2", "t.py"]),
    (["--log_dir", "logs", "--max_restarts", "2", "--np", "2", "t.py"],
     ["--log-dir", "logs", "--max-restarts", "2", "--np", "2", "t.py"]),
    # the static backend's master address is the rendezvous for several hosts, nothing on one
    (["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "1234", "t.py"],
     ["--np", "2", "--rdzv-endpoint", "10.0.0.1:1234", "t.py"]),
    (["--nnodes", "2", "--master_addr=10.0.0.1", "t.py"], ["--np", "2", "--rdzv-endpoint", "10.0.0.1:29500", "t.py"]),
    (["--master-port", "1234", "--nproc-per-node", "2", "t.py"], ["--nproc-per-node", "2", "--np", "2", "t.py"]),
    (["--standalone", "--nproc-per-node", "2", "-m", "pkg.train", "--lr", "1"],
     ["-m", "--nproc-per-node", "2", "--np", "2", "pkg.train", "--lr", "1"]),
    (["--module", "--np", "2", "pkg"], ["-m", "--np", "2", "pkg"]),
    (["--local-addr", "10.0.0.7", "--shutdown_timeout", "9", "--np", "2", "t.py"],
     ["--host-addr", "10.0.0.7", "--grace-period", "9", "--np", "2", "t.py"]),
    (["--rdzv-conf", "join_timeout=30,last_call_timeout=2,heartbeat_timeout=12,read_timeout=5", "--np", "2", "t.py"],
     ["--rdzv-timeout", "30", "--rdzv-settle", "2", "--rdzv-ttl", "12", "--np", "2", "t.py"]),
    (["--rdzv-conf=timeout=40,join_timeout=30,ca_cert=ca.pem", "--np", "2", "t.py"],
     ["--rdzv-timeout", "30", "--etcd-ca", "ca.pem", "--np", "2", "t.py"]),
    # accepted with no effect: what elastic-run does anyway
    (["--monitor-interval", "1", "--start-method", "fork", "--run-path", "--tee", "3", "-r", "3",
      "--local-ranks-filter", "0", "--role", "default", "--event-log-handler", "null", "--np", "2", "t.py"],
     ["--np", "2", "t.py"]),
    # everything after SCRIPT is the script's, torchrun spellings included
    (["--np", "2", "t.py", "--nnodes", "3", "--nproc_per_node=gpu"], ["--np", "2", "t.py", "--nnodes", "3",
                                                                      "--nproc_per_node=gpu"]),
    (["--nnodes", "1", "--", "--standalone"], ["--np", "1", "--", "--standalone"]),
]


@pytest.mark.parametrize("argv, expected", TRANSLATED)
def test_torchrun_spellings_become_elastic_runs(argv, expected):
    assert torchrun.translate(argv, VALUE_FLAGS, {}, DEVICES).argv == expected


def test_options_with_no_effect_say_so():
    notes = torchrun.translate(["--monitor_interval", "1", "--node-rank", "2", "--rdzv-conf", "is_host=1", "t.py"],
                               VALUE_FLAGS, {}, DEVICES).notes
    assert [n.split(":")[0] for n in notes] == ["--monitor_interval has no effect here", "--node-rank has no effect here",
                                                "--rdzv-conf is_host"]


REFUSED = [
    # (argv, the start of the one line)
    (["--no-python", "./a.out"], "torchrun's --no-python is not supported by elastic-run: elastic-run runs SCRIPT "
                                 "with Python"),
    (["--no_python", "./a.out"], "torchrun's --no_python is not supported"),
    (["--numa_binding", "node", "t.py"], "torchrun's --numa_binding is not supported by elastic-run: no NUMA"),
    (["--logs-specs", "x", "t.py"], "torchrun's --logs-specs is not supported"),
    (["--signals-to-handle", "SIGHUP", "t.py"], "torchrun's --signals-to-handle is not supported by elastic-run: "
                                                "elastic-run handles SIGTERM and SIGINT"),
    (["--virtual-local-rank", "t.py"], "torchrun's --virtual-local-rank is not supported"),
    (["--duplicate-stdout-filters", "0", "t.py"], "torchrun's --duplicate-stdout-filters is not supported"),
    (["--nnodes", "2", "--np", "4", "t.py"], "--nnodes counts hosts and --np workers: give one of them"),
    (["--nnodes=2", "-np", "4", "t.py"], "--nnodes counts hosts and -np workers"),
    (["--nnodes", "3:2", "t.py"], "--nnodes 3:2: expected N or MIN:MAX hosts"),
    (["--nnodes", "x", "t.py"], "--nnodes x: expected"),
    (["--nproc_per_node", "xpu", "t.py"], "--nproc_per_node xpu: expected a positive number, gpu, cpu or auto"),
    (["--nproc-per-node", "0", "t.py"], "--nproc-per-node 0: expected"),
    (["--rdzv-backend", "zeus", "--rdzv-endpoint", "h:1", "t.py"], "--rdzv-backend zeus: elastic-run's rendezvous "
                                                                    "is etcd v3"),
    (["--rdzv_conf", "foo=1", "t.py"], "--rdzv_conf foo: not a setting of elastic-run's rendezvous"),
    (["--rdzv-conf", "join_timeout", "t.py"], "--rdzv-conf join_timeout: expected KEY=VALUE"),
    (["--standalone", "--rdzv-endpoint", "h:1", "t.py"], "--standalone runs on this host alone: drop --rdzv-endpoint"),
    (["--rdzv-id", "a", "--job-id", "b", "t.py"], "--rdzv-id is --job-id: give one of them"),
    (["--role", "trainer", "t.py"], "--role trainer: one role per job here"),
    (["--event-log-handler", "console", "t.py"], "--event-log-handler console: only null here"),
    (["--standalone=1", "t.py"], "--standalone takes no value"),
    (["--nnodes"], "--nnodes needs a value"),
]


@pytest.mark.parametrize("argv, starts", REFUSED)
def test_what_has_no_meaning_here_is_refused_in_one_line(argv, starts):
    with pytest.raises(ConfigError) as refused:
        torchrun.translate(argv, VALUE_FLAGS, {}, DEVICES)
    assert str(refused.value).startswith(starts) and "\n" not in str(refused.value)


def test_nnodes_is_refused_with_a_world_size_from_the_environment():
    with pytest.raises(ConfigError, match="ELASTIC_MIN_NP"):
        torchrun.translate(["--nnodes", "2", "t.py"], VALUE_FLAGS, {"ELASTIC_MIN_NP": "2"}, DEVICES)
    assert torchrun.translate(["--nproc-per-node", "2", "t.py"], VALUE_FLAGS, {"ELASTIC_NP": "4"}, DEVICES).argv \
        == ["--nproc-per-node", "2", "t.py"]


def test_nproc_per_node_gpu_without_a_gpu_is_refused_auto_counts_cpus():
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        torchrun.translate(["--nproc-per-node", "gpu", "t.py"], VALUE_FLAGS, {}, NO_GPU)
    assert torchrun.translate(["--nproc-per-node", "auto", "t.py"], VALUE_FLAGS, {}, NO_GPU).argv[:2] \
        == ["--nproc-per-node", "4"]


def test_parse_reads_torchruns_documented_multinode_command(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    config, args = parse(["--nnodes=2:8", "--nproc_per_node=2", "--max-restarts=3", "--rdzv-id=job42",
                          "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1", str(script), "--epochs", "1"])
    assert (config.settings.min_np, config.settings.max_np, config.nproc_per_node) == (4, 16, 2)
    assert (config.job_id, config.max_restarts, args.rdzv_endpoint) == ("job42", 3, "127.0.0.1:29400")
    assert config.command == (str(script), "--epochs", "1")


def test_a_refused_torchrun_option_is_one_line_and_exit_2(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("")
    assert main(["--numa-binding", "node", "--nproc-per-node", "2", str(script)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "elastic-run: error: torchrun's --numa-binding is not supported by elastic-run: no NUMA binding in "
        "elastic-run: bind in the script (os.sched_setaffinity by LOCAL_RANK)"]


# -- the join hint ---------------------------------------------------------------------------


JOIN_HINTS = [
    # (endpoint, settings, workers here, command, what the printed command must hold)
    ("127.0.0.1:2400", RendezvousSettings(min_np=2, max_np=8), 4, ("/x/t.py", "--epochs", "5"),
     "elastic-run --rdzv-endpoint 127.0.0.1:2400 --job-id local --min-np 2 --max-np 8 /x/t.py --epochs 5"),
    ("127.0.0.1:2400", RendezvousSettings(min_np=2, max_np=2), 2, ("-m", "pkg.train", "--name", "a b"),
     "elastic-run --rdzv-endpoint 127.0.0.1:2400 --job-id local --min-np 2 --max-np 2 -m pkg.train --name 'a b'"),
]


@pytest.mark.parametrize("endpoint, settings, here, command, expected", JOIN_HINTS)
def test_the_join_hint_is_a_whole_command(endpoint, settings, here, command, expected):
    hint = join_hint(endpoint, "local", settings, command, here)
    printed = re.search(r"join with: (.*?)(?: \(|;|$)", hint).group(1)
    assert printed == expected and "..." not in hint
    assert "from this machine only" in hint and "that host serves the rendezvous" in hint
    assert ("waits as a spare" in hint) == (here >= settings.max_np)


def test_the_join_hint_makes_a_relative_script_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hint = join_hint("10.0.0.5:2379", "j", RendezvousSettings(min_np=1, max_np=2), ("t.py",), 1)
    assert f" {tmp_path / 't.py'}" in hint and "this machine only" not in hint


def test_the_join_hint_of_a_secured_job_names_the_secret_file_to_copy():
    secret = (["--job-secret-file", "/home/u/job.secret"], "copy /home/u/job.secret to every host first, mode 0600")
    hint = join_hint("10.0.0.5:29400", "j", RendezvousSettings(min_np=2, max_np=4), ("/x/t.py",), 1, secret=secret)
    printed = re.search(r"join with: (.*?)(?: \(|;|$)", hint).group(1)
    assert printed == ("elastic-run --rdzv-endpoint 10.0.0.5:29400 --job-id j --job-secret-file /home/u/job.secret "
                       "--min-np 2 --max-np 4 /x/t.py")
    assert "(copy /home/u/job.secret to every host first, mode 0600)" in hint


def test_with_torchruns_c10d_backend_errors_speak_of_the_rendezvous():
    from elastic.cli.launch import in_users_words

    message = "cannot reach etcd at localhost:29400 within 3s: UNAVAILABLE: Connection refused"
    assert in_users_words(message, "c10d") == \
        "cannot reach the rendezvous at localhost:29400 within 3s: UNAVAILABLE: Connection refused"
    assert in_users_words(message, "etcd") == message  # the user asked for etcd
