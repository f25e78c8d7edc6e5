"""horovodrun's spellings under elastic-run: a table of command lines and what they become."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.fakes.jobs import REPO

from elastic.cli import horovodrun
from elastic.cli.launch import build_parser, main, parse
from elastic.rendezvous import ConfigError

VALUE_FLAGS = horovodrun.value_flags_of(build_parser())

TRANSLATED = [
    # (horovodrun-style argv, elastic-run argv, environment)
    (["-np", "4", "python", "train.py", "--lr", "1"], ["--np", "4", "train.py", "--lr", "1"], {}),
    (["--num-proc=2", "python3", "train.py"], ["--np", "2", "train.py"], {}),
    (["-np", "4", "--min-num-proc", "2", "--max-num-proc", "8", "/usr/bin/python3.11", "t.py"],
     ["--np", "4", "--min-np", "2", "--max-np", "8", "t.py"], {}),
    (["--min-np", "2", "--max-np", "3", "t.py"], ["--min-np", "2", "--max-np", "3", "t.py"], {}),
    (["--slots-per-host", "2", "t.py"], ["--nproc-per-node", "2", "t.py"], {}),
    (["-H", "localhost:3", "t.py"], ["--nproc-per-node", "3", "t.py"], {}),
    (["--hosts=127.0.0.1:2", "t.py"], ["--nproc-per-node", "2", "t.py"], {}),
    (["--reset-limit", "5", "t.py"], ["--max-resets", "5", "t.py"], {}),
    (["--elastic-timeout", "60", "t.py"], ["--rdzv-timeout", "60", "t.py"], {}),
    (["--start-timeout", "30", "t.py"], ["--rdzv-timeout", "30", "t.py"], {}),
    (["--elastic-timeout", "60", "--start-timeout", "30", "t.py"], ["--rdzv-timeout", "60", "t.py"], {}),
    (["--gloo-timeout-seconds", "20", "t.py"], ["--collective-timeout", "20", "t.py"], {}),
    (["--output-filename", "logs", "t.py"], ["--log-dir", "logs", "t.py"], {}),
    (["--network-interface", "eth1", "t.py"], ["t.py"], {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "eth1"}),
    (["--gloo", "-np", "2", "python", "-m", "pkg.train", "-x"], ["--np", "2", "-m", "pkg.train", "-x"], {}),
    (["-np", "2", "python", "-u", "t.py"], ["--np", "2", "t.py"], {}),
    # elastic-run's own options (and their values, abbreviated too) pass through untouched
    (["--log-dir", "python", "--np", "2", "t.py"], ["--log-dir", "python", "--np", "2", "t.py"], {}),
    (["--nproc", "2", "python", "t.py"], ["--nproc", "2", "t.py"], {}),
    (["--evict-stragglers", "-np", "2", "t.py"], ["--evict-stragglers", "--np", "2", "t.py"], {}),
    # everything after SCRIPT is the script's, Horovod spellings included
    (["-np", "2", "t.py", "-np", "9", "python"], ["--np", "2", "t.py", "-np", "9", "python"], {}),
    (["-np", "2", "--", "python"], ["--np", "2", "--", "python"], {}),
]


@pytest.mark.parametrize("argv, expected, env", TRANSLATED)
def test_horovodrun_spellings_become_elastic_runs(argv, expected, env):
    translation = horovodrun.translate(argv, VALUE_FLAGS)
    assert translation.argv == expected
    assert translation.env == env
    assert not translation.shim


REFUSED = [
    (["-H", "a:2,b:2", "t.py"], "--rdzv-endpoint"),
    (["--hosts", "host1:4", "t.py"], "--nproc-per-node N"),
    (["-hostfile", "hosts.txt", "t.py"], "--rdzv-endpoint"),
    (["--host-discovery-script", "d.sh", "t.py"], "agents registered in etcd"),
    (["--mpi", "t.py"], "--backend gloo or nccl"),
    (["--blacklist-cooldown-range", "1", "10", "t.py"], "--max-restarts"),
    (["--ssh-port", "22", "t.py"], "no ssh"),
    (["--fusion-threshold-mb", "32", "t.py"], "backend tuning"),
    (["--timeline-filename", "t.json", "t.py"], "elastic-run timeline"),
    (["--no-stall-check", "t.py"], "--hang-timeout"),
    (["-np", "2", "python", "-c", "print(1)"], "interpreter options"),
]


@pytest.mark.parametrize("argv, names", REFUSED)
def test_options_without_a_meaning_here_are_refused_naming_the_equivalent(argv, names):
    with pytest.raises(ConfigError) as refused:
        horovodrun.translate(argv, VALUE_FLAGS)
    message = str(refused.value)
    assert names in message and "\n" not in message
    if argv[0] != "-np":
        assert message.startswith(f"horovodrun's {argv[0]} is not supported by elastic-run: ")


def test_reset_limit_says_how_it_differs_and_the_shim_is_opt_in():
    translation = horovodrun.translate(["--reset-limit", "3", "--horovod-shim", "t.py"], VALUE_FLAGS)
    assert translation.argv == ["--max-resets", "3", "t.py"] and translation.shim
    assert any("planned resizes" in note for note in translation.notes)
    assert horovodrun.translate(["t.py"], VALUE_FLAGS, {"ELASTIC_HOROVOD_SHIM": "1"}).shim


def test_parse_reads_a_horovodrun_command_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    config, args = parse(["-np", "3", "--min-num-proc", "2", "--reset-limit", "4", "python", str(script), "--x"])
    assert (config.settings.min_np, config.settings.max_np, config.nproc_per_node) == (2, 3, 3)
    assert config.max_resets == 4 and config.command == (str(script), "--x")


def test_a_refused_option_is_one_line_and_exit_2(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("")
    assert main(["--mpi", "-np", "2", str(script)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "elastic-run: error: horovodrun's --mpi is not supported by elastic-run: elastic-run runs on "
        "torch.distributed: --backend gloo or nccl"]


# -- --horovod-shim ---------------------------------------------------------------------


def test_the_shim_never_shadows_a_real_horovod():
    environ = {"PYTHONPATH": "/somewhere"}
    assert horovodrun.install_shim(environ, importable=lambda: True) is None
    assert environ == {"PYTHONPATH": "/somewhere"}


def test_the_shim_serves_import_horovod_torch_from_elastic_horovod(tmp_path):
    environ = {"PYTHONPATH": str(REPO)}
    directory = horovodrun.install_shim(environ, importable=lambda: False)
    assert environ["PYTHONPATH"] == directory + os.pathsep + str(REPO)
    probe = ("import horovod.torch as hvd, elastic.horovod, horovod.torch.elastic as e\n"
             "from horovod.common.elastic import ObjectState\n"
             "assert hvd is elastic.horovod and e is elastic.horovod.elastic and ObjectState is e.ObjectState\n"
             "print('ok')")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                            env={**os.environ, **environ}, cwd=tmp_path)
    assert result.stdout.strip() == "ok", result.stderr[-2000:]
