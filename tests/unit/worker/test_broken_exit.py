"""An uncaught error leaves its fault as the worker's exit record; a broken process exits
WORKER_BROKEN, under torch's own excepthook too."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elastic.contract.exit_codes import WORKER_BROKEN
from elastic.contract.faults import NETWORK, PROCESS, RING, USER, ExitRecord, Fault, read_record
from tests.fakes.jobs import REPO

SCRIPT = """
import sys, torch, torch.distributed as dist
from elastic.worker import lifecycle
lifecycle._report_errors_to(sys.argv[1])
# init_process_group wraps sys.excepthook in one that buffers stderr until it returns
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
raise {error}
"""


@pytest.mark.parametrize("error, code, report", [
    ('torch.AcceleratorError("CUDA error: an illegal memory access was encountered")', WORKER_BROKEN,
     Fault(PROCESS, "AcceleratorError: CUDA error: an illegal memory access was encountered")),
    ('ValueError("bad batch")', 1, Fault(USER, "ValueError: bad batch")),  # a user error: the record, exit 1
    # A broken ring that escaped elastic.run: a crash for the agent to replace, said as such.
    ('dist.DistNetworkError("Connection reset by peer")', 1, Fault(RING, "DistNetworkError: Connection reset by peer")),
    ('__import__("elastic.contract.errors").contract.errors.PeersUnreachable(2, ["10.0.0.1"], "refused")', 1,
     Fault(NETWORK, "round 2: workers could not connect to each other at 10.0.0.1 (refused); check --host-addr, "
                    "GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME and firewalls")),
])
def test_the_exit_status_and_report_of_each_kind(tmp_path, error, code, report):
    report_file = tmp_path / "error"
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(error=error), str(report_file)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == code, done.stderr
    assert read_record(str(report_file)) == ExitRecord(fault=report)
    if code == WORKER_BROKEN:
        lines = [line for line in done.stderr.splitlines() if line.startswith("elastic: broken process")]
        assert len(lines) == 1 and report.reason in lines[0], done.stderr
        assert "Traceback" in done.stderr  # the details, for the worker's log file
