"""On/off values pass through a worker's environment as what they are."""

from __future__ import annotations

import pytest

from elastic.contract.worker_config import WorkerConfig


@pytest.mark.parametrize("flag", [True, False])
def test_an_on_off_value_survives_the_environment(flag):
    config = WorkerConfig(job_id="j", endpoints="e:1", worker_id="w", member_id="m", host_id="h", round=1,
                          checkpoint_dir="/c", checkpoint_allow_fresh_start=flag)
    assert WorkerConfig.from_env(config.to_env()).checkpoint_allow_fresh_start is flag


def test_every_field_is_read_back_as_its_type():
    from elastic.contract.worker_config import _PARSE

    assert {str(f.type) for f in WorkerConfig.__dataclass_fields__.values()} <= set(_PARSE)
    config = WorkerConfig(job_id="j", endpoints="e:1", worker_id="w", member_id="m", host_id="h", round=1,
                          checkpoint_every=5, checkpoint_interval=2.5, device_slot=0, hang_timeout=0.0)
    assert WorkerConfig.from_env(config.to_env()) == config


def test_the_agents_timeouts_reach_the_worker_whole(tmp_path):
    from elastic.agent.config import config_for_worker
    from elastic.cli.launch import parse

    script = tmp_path / "train.py"
    script.write_text("")
    agent, _ = parse(["--np", "2", "--rdzv-ttl", "7", "--collective-timeout", "40", "--rdzv-timeout", "90",
                      "--rdzv-settle", "1.5", "--hang-timeout", "120", str(script)])
    worker = config_for_worker(agent, "m.w0", 1, endpoints="127.0.0.1:2379", member_id="m", events_file="e",
                               scratch=str(tmp_path), progress_file=None, stacks_file=None, final_checkpoint_file="f")
    timeouts = WorkerConfig.from_env(worker.to_env()).timeouts
    assert timeouts == agent.timeouts
    assert (timeouts.ttl, timeouts.collective, timeouts.rendezvous, timeouts.settle, timeouts.hang) == (
        7.0, 40.0, 90.0, 1.5, 120.0)
    assert timeouts.succession_patience == 14.0  # the agent's look for a dead coordinator: two TTLs
