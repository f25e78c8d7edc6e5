"""State.sync over a real gloo ring on loopback: a sync that breaks half-way must
leave every receiver's last commit intact (issue 12, item 2)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from tests.fakes.jobs import REPO

pytestmark = pytest.mark.timeout(120)


def run_ring(world: int, *extra: str) -> list[dict]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen([sys.executable, "-m", "tests.fakes.sync_worker", str(rank), str(world), str(store.port),
                          *extra], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in range(world)
    ]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=90)
            assert proc.returncode == 0, err[-3000:]
            results.extend(json.loads(line) for line in out.splitlines() if line.startswith("{"))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)
    return sorted(results, key=lambda r: r["rank"])


def test_a_complete_sync_delivers_rank0s_state():
    results = run_ring(3)
    assert [r["rank"] for r in results] == [0, 1, 2]
    for r in results:
        assert r["outcome"] == "synced"
        assert (r["weights"], r["counts"], r["step"]) == ([4.0], [4], 4)


@pytest.mark.parametrize("buffers_sent", [0, 1])
def test_rank0_dying_mid_sync_leaves_the_previous_commit(buffers_sent):
    """Rank 0 exits after the layout and `buffers_sent` of the two buffers."""
    results = run_ring(3, "--die-after-buffers", str(buffers_sent))
    receivers = [r for r in results if r["rank"] != 0]
    assert [r["rank"] for r in receivers] == [1, 2]
    for r in receivers:
        assert r["outcome"].startswith("failed")
        # The last commit (3), never zeros nor a mix of the new and the old state.
        assert (r["weights"], r["counts"], r["step"]) == ([3.0], [3], 3), r
