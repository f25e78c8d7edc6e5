"""elastic-run's exit status says how the job ended, on every host alike: a user error is 3."""

from __future__ import annotations

import json
import uuid

import pytest

from elastic.contract.exit_codes import USER_ERROR
from elastic.rendezvous import JobKeys
from elastic.rendezvous.control import CAUSE_USER_CODE
from tests.fakes.jobs import one_worker_hosts

pytestmark = pytest.mark.timeout(240)


def test_a_user_error_on_one_host_makes_every_agent_exit_3(tmp_path, etcd_server, etcd):
    job_id = f"user-error-{uuid.uuid4().hex[:10]}"
    # Rank 1 raises in the training function; which host holds it is the rendezvous's choice.
    agents = one_worker_hosts(tmp_path, etcd_server.endpoint, job_id, [],
                              ["--steps", "100", "--fail-rank", "1", "--fail-step", "3"])
    codes = [agent.wait(180) for agent in agents]
    assert codes == [USER_ERROR, USER_ERROR], [agent.text()[-2000:] for agent in agents]
    # One host saw its worker raise; the other only read the job's status.
    saw = [[e for e in agent.events() if e["event"] == "failure_detected" and e.get("user_error")] for agent in agents]
    assert sorted(len(found) for found in saw) == [0, 1], saw
    for agent in agents:  # each says why, in one line, whichever host's worker raised
        failed = [line for line in agent.text().splitlines() if line.startswith(f"elastic-run: job {job_id} failed: ")]
        assert len(failed) == 1 and "ValueError: bad batch at step 3" in failed[0], agent.text()[-2000:]
        assert not [e for e in agent.events() if e["event"] == "reform_done"]  # no re-form loop
    status = json.loads(etcd.get(JobKeys(job_id).status).value)
    assert status["state"] == "failed" and status["cause"] == CAUSE_USER_CODE, status
