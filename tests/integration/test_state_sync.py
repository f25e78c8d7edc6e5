"""State.sync over a real gloo ring on loopback: the ring goes on from its newest
commit, only workers without it receive, and a sync that breaks half-way leaves
every receiver's last commit intact (issues 9 and 12)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from tests.fakes.jobs import REPO

pytestmark = pytest.mark.timeout(300)


def run_ring(world: int, scenario: str, *extra: str) -> list[dict]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen([sys.executable, "-m", "tests.fakes.sync_worker", str(rank), str(world), str(store.port),
                          scenario, *extra], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in range(world)
    ]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=150)  # importing torch alone takes 30 s on a busy 2-core machine
            assert proc.returncode == 0, err[-3000:]
            results.extend(json.loads(line) for line in out.splitlines() if line.startswith("{"))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)
    return sorted(results, key=lambda r: r["rank"])


def test_the_ring_goes_on_from_its_newest_commit_and_only_the_others_receive():
    """Ranks 0, 1 hold commit 2 of round 2; rank 2 holds commit 3 of round 1 (an older
    history); rank 3 holds nothing. Everybody ends with the value of round 2's commit."""
    results = run_ring(4, "mixed")
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    for r in results:
        assert r["outcome"] == "synced: holders [0, 1] receivers [2, 3]", r
        assert (r["weights"], r["counts"], r["step"], r["commit"]) == ([2.0], [2], 2, [2, 2]), r
    # Holders receive nothing but the holdings (3 int64 per rank): not the layout, not a
    # byte of the state. The receivers get the state (4 MB of weights) and the layout.
    for r in results[:2]:
        assert r["received"] == {"all_gather": 4 * 3 * 8}, r
    for r in results[2:]:
        assert r["received"]["all_gather"] == 4 * 3 * 8, r
        assert r["received"]["irecv"] >= (1 << 20) * 4 + 10 * 8, r


def test_rank_0_behind_receives_from_the_holders_like_any_other_worker():
    """Rank 0 rolled back one commit further than ranks 1 and 2, and rank 3 is a joiner:
    rank 0 is a receiver (the layout comes from rank 1, the first holder), and the ring
    goes on from the holders' commit, never from rank 0's older one."""
    results = run_ring(4, "rank0-behind")
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    for r in results:
        assert r["outcome"] == "synced: holders [1, 2] receivers [0, 3]", r
        assert (r["weights"], r["counts"], r["step"], r["commit"]) == ([2.0], [2], 2, [1, 2]), r
    for r in (results[1], results[2]):
        assert r["received"] == {"all_gather": 4 * 3 * 8}, r
    for r in (results[0], results[3]):
        assert r["received"]["irecv"] >= (1 << 20) * 4 + 10 * 8, r


def test_a_holder_dying_mid_sync_leaves_the_receivers_previous_commit():
    """Rank 0 alone holds commit 4 and exits after two of its chunks: the receivers,
    which received into their own snapshot, restore commit 3, never a mix."""
    results = run_ring(3, "holder-dies")
    receivers = [r for r in results if r["rank"] != 0]
    assert [r["rank"] for r in receivers] == [1, 2]
    for r in receivers:
        assert r["outcome"].startswith("failed"), r
        assert (r["weights"], r["counts"], r["step"], r["commit"]) == ([3.0], [3], 3, [1, 3]), r
