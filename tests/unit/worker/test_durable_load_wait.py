"""After a total loss, holders[0] loads the durable checkpoint before it
sends the layout; the receivers' wait for it is bounded by --rdzv-timeout, not by the
group's timeout (--collective-timeout), which a load of tens of GB outlasts.

A real gloo ring of two processes whose group timeout is 1 s; the sender "loads" for 3 s."""

import json
import os
import subprocess
import sys

_SCRIPT = """
import datetime, json, sys, time, torch, torch.distributed as dist
from elastic.checkpoint.snapshot import Snapshot
from elastic.worker import state_transfer
rank, store_path = int(sys.argv[1]), sys.argv[2]
WAIT = None if len(sys.argv) > 3 else 30
dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=1))
snap = Snapshot()
snap.capture({"w": torch.arange(4.0), "epoch": 3})
if rank == 0:
    time.sleep(3)  # the durable load
    state_transfer.send_layout(snap.layout(), [1], "gloo")
    dist.barrier()
    print(json.dumps({"sent": True}), flush=True)
else:
    started = time.monotonic()
    layout = state_transfer.receive_layout(0, "gloo", wait_s=WAIT)
    waited = time.monotonic() - started
    dist.barrier()
    print(json.dumps({"ok": layout == snap.layout(), "waited": waited}), flush=True)
"""


def test_receivers_wait_for_a_durable_load_longer_than_the_collective_timeout(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    procs = [subprocess.Popen([sys.executable, "-c", _SCRIPT, str(rank), str(tmp_path / "store")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outputs]
    result = json.loads(outputs[1][0].strip().splitlines()[-1])
    assert result["ok"] and result["waited"] > 2.0, result  # past the group's 1 s timeout
