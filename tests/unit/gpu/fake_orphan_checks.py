"""A fake check for the harness's orphan test (test_check_orphans.py): it starts a child
in a session of its own, as an agent or an NCCL child does, writes the child's pid, and
hangs. No torch here: the check's process imports this module."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.gpu.check_base import Check

PID_FILE = "orphan.pid"


def _leaves_an_orphan(ctx):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    (ctx.workdir / PID_FILE).write_text(str(child.pid))
    time.sleep(600)


ORPHANS = (Check("leaves_an_orphan", "N11", 600, _leaves_an_orphan, needs=()),)
