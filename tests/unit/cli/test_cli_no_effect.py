"""An option that changes nothing is warned about, as typed (flag or variable), as a table."""

from __future__ import annotations

import logging

import pytest

from elastic.cli import launch as cli
from elastic.cli.no_effect import NO_EFFECT, dest, warnings
from elastic.rendezvous import ConfigError


@pytest.mark.parametrize("given, values, expected", [
    ({"checkpoint_every": "--checkpoint-every"}, {"checkpoint_every": 10},
     ["--checkpoint-every has no effect without --checkpoint-dir: no durable checkpoint is written"]),
    ({"checkpoint_every": "--checkpoint-every"}, {"checkpoint_every": 10, "checkpoint_dir": "/c"}, []),
    ({"checkpoint_keep": "ELASTIC_CHECKPOINT_KEEP"}, {},
     ["ELASTIC_CHECKPOINT_KEEP has no effect without --checkpoint-dir: no durable checkpoint is written"]),
    ({"chaos_seed": "--chaos-seed"}, {"chaos_seed": 3},
     ["--chaos-seed has no effect without --chaos-kill-every: no worker is killed"]),
    ({"chaos_seed": "--chaos-seed"}, {"chaos_kill_every": 5.0}, []),
    ({"health_addr": "--health-addr"}, {}, ["--health-addr has no effect without --health-port: "
                                            "no /healthz or /metrics server is started"]),
    ({"etcd_ca": "--etcd-ca", "etcd_user": "--etcd-user"}, {},
     ["--etcd-ca has no effect without --rdzv-endpoint: the embedded etcd takes no TLS",
      "--etcd-user has no effect without --rdzv-endpoint: the embedded etcd takes no credentials"]),
    ({"etcd_ca": "--etcd-ca"}, {"rdzv_endpoint": "e:2379"}, []),
    ({"np": "--np", "log_dir": "--log-dir"}, {}, []),
])
def test_warnings_table(given, values, expected):
    assert warnings(given, values) == expected


def test_every_row_names_real_options():
    flags = {flag for action in cli.build_parser()._actions for flag in action.option_strings}
    for flag, needed, _ in NO_EFFECT:
        assert flag in flags and needed in flags and dest(flag) != dest(needed)


def test_the_launcher_warns_once_and_still_starts(tmp_path, caplog):
    script = tmp_path / "train.py"
    script.write_text("")
    with caplog.at_level(logging.WARNING):
        config, _ = cli.parse(["--np", "1", "--backend", "gloo", "--checkpoint-every", "5", str(script)])
    assert config.checkpoint == {}
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert lines == ["--checkpoint-every has no effect without --checkpoint-dir: no durable checkpoint is written"]


def test_timeouts_that_cannot_work_are_refused_and_suspicious_ones_said_once(tmp_path, caplog):
    # The rule itself is a table (tests/unit/contract/test_timeouts.py); here: the launcher applies it.
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(ConfigError, match="--rdzv-settle 9 is not below --rdzv-timeout 5"):
        cli.parse(["--np", "1", "--backend", "gloo", "--rdzv-settle", "9", "--rdzv-timeout", "5", str(script)])
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        cli.parse(["--np", "1", "--backend", "gloo", "--collective-timeout", "5", str(script)])
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 1 and lines[0].startswith("--collective-timeout 5 is below --rdzv-ttl 10")
