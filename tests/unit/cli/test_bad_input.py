"""Bad numbers on the command line are one line and exit 2 (review finding 11), as a table.

Each of these once got past the contract: a traceback (--health-port 70000, a port in use,
inf timeouts) or a silent hang (--rdzv-settle nan never forms a round)."""

from __future__ import annotations

import socket

import pytest

from elastic.agent.health import HealthServer
from elastic.cli import launch as cli
from elastic.rendezvous import ConfigError


@pytest.mark.parametrize("option, value", [
    ("--health-port", "70000"), ("--health-port", "-1"),
    ("--rdzv-timeout", "inf"), ("--rdzv-ttl", "inf"), ("--collective-timeout", "inf"),
    ("--rdzv-settle", "nan"), ("--rdzv-settle", "inf"), ("--rdzv-settle", "-1"),
    ("--grace-period", "inf"), ("--final-checkpoint-timeout", "inf"), ("--checkpoint-interval", "inf"),
    ("--etcd-retry-deadline", "inf"), ("--chaos-kill-every", "inf"), ("--hang-timeout", "inf"),
    ("--straggler-ratio", "inf"), ("--reset-window", "nan"),
])
def test_a_bad_number_is_refused_while_parsing(tmp_path, option, value):
    script = tmp_path / "t.py"
    script.write_text("")
    with pytest.raises(ConfigError, match=option):
        cli.parse(["--np", "1", "--backend", "gloo", f"{option}={value}", str(script)])


def test_good_numbers_still_pass(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("")
    config, _ = cli.parse(["--np", "1", "--backend", "gloo", "--health-port", "0", "--rdzv-settle", "0",
                           "--hang-timeout", "off", str(script)])
    assert config.health_port == 0 and config.settings.settle == 0 and config.hang_timeout == 0


def test_a_health_port_in_use_is_a_config_error_which_main_prints_in_one_line_with_exit_2():
    # Agent starts the server; launch.main turns a ConfigError into "elastic-run: error: ..." and 2.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"^--health-port {port}: cannot listen on 127.0.0.1:{port}: "
                                              "Address already in use$"):
            HealthServer(port, lambda: (True, "ok"), host="127.0.0.1").start()
