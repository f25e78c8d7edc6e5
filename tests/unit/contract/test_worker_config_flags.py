"""On/off values pass through a worker's environment as what they are."""

from __future__ import annotations

import pytest

from elastic.contract.worker_config import WorkerConfig


@pytest.mark.parametrize("flag", [True, False])
def test_an_on_off_value_survives_the_environment(flag):
    config = WorkerConfig(job_id="j", endpoints="e:1", worker_id="w", member_id="m", host_id="h", round=1,
                          checkpoint_dir="/c", checkpoint_allow_fresh_start=flag)
    assert WorkerConfig.from_env(config.to_env()).checkpoint_allow_fresh_start is flag
