"""A broken process exits WORKER_BROKEN with its one-line report, under torch's own excepthook too."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elastic.contract.exit_codes import WORKER_BROKEN
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
     "AcceleratorError: CUDA error: an illegal memory access was encountered"),
    ('ValueError("bad batch")', 1, "ValueError: bad batch"),  # a user error: the report, exit 1
])
def test_the_exit_status_and_report_of_each_kind(tmp_path, error, code, report):
    report_file = tmp_path / "error"
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(error=error), str(report_file)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == code, done.stderr
    assert report_file.read_text().strip() == report
    if code == WORKER_BROKEN:
        lines = [line for line in done.stderr.splitlines() if line.startswith("elastic: broken process")]
        assert len(lines) == 1 and report in lines[0], done.stderr
        assert "Traceback" in done.stderr  # the details, for the worker's log file
