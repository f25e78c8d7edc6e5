"""The switch decision agreed in the ring, not read from the store (security review 2, H4).

A table for what rank 0 posts and the others take, then a real gloo ring of three
processes: rank 0 decides at a point, every rank joins the broadcast it posts there and
takes it at the next point, where all act at the same commit; rank 0's commit never
waits for the others' (the broadcast is posted, not awaited); a stranger's value in a
store plays no part."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elastic.contract.errors import PeerDataInvalid
from elastic.worker.switch_points import SwitchPoints, decision_words, read_decision


@pytest.mark.parametrize("decided, commits, expected", [
    (None, 3, None),
    ((4, "switch"), 8, "switch"),  # posted at the point 4, taken at the point 8
    ((7, "stop"), 8, "stop"),
])
def test_decisions_round_trip(decided, commits, expected):
    assert read_decision(decision_words(decided), commits) == expected


@pytest.mark.parametrize("words", [[4, 1], [9, 2], [-3, 1], [2, 3], [2, -1]])
def test_an_impossible_decision_from_rank_0_is_a_ring_fault(words):
    # Decided at this point or a later one, before the first commit, or an unknown action.
    with pytest.raises(PeerDataInvalid):
        read_decision(words, 4)


_RANK = r"""
import datetime, sys, torch.distributed as dist
import os, time
from elastic.worker.switch_points import SwitchPoints, decision_words, read_decision, ring_exchange
rank, path, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", store=dist.FileStore(path, 3), rank=rank, world_size=3,
                        timeout=datetime.timedelta(seconds=30))
points, posted, wants = SwitchPoints(), None, False
points.agree(0, 0.1)  # every 2 commits from 0 (0.25 s at 0.1 s a commit)
for commits in range(1, 20):
    wants = wants or (rank == 0 and commits == 5)  # rank 0 sees a reason between points
    if commits == 6 and rank == 1:  # rank 0's commit at the point 6 does not wait for ours
        deadline = time.monotonic() + 30
        while not os.path.exists(out) and time.monotonic() < deadline:
            time.sleep(0.01)
        print("rank 0 went on" if os.path.exists(out) else "rank 0 waited", flush=True)
    if points.is_point(commits):
        action = read_decision(posted(), commits) if posted is not None else None
        if action is not None:
            print(f"{action} at {commits}", flush=True)
            break
        posted = ring_exchange(decision_words((commits, "switch") if wants else None))
    if commits == 6 and rank == 0:
        open(out, "w").close()
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_every_rank_acts_at_the_commit_rank_0_decided(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(rank), str(tmp_path / "store"), str(tmp_path / "past6")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(3)]
    results = [proc.communicate(timeout=100) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0], [err[-1500:] for _, err in results]
    # Decided at the point 6, taken and acted on at the point 8 by every rank.
    assert [out.strip() for out, _ in results] == ["switch at 8", "rank 0 went on\nswitch at 8", "switch at 8"]
