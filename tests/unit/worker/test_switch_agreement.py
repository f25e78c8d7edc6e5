"""The switch decision agreed in the ring, not read from the store (security review 2, H4).

A table for what rank 0 sends and the others read, then a real gloo ring of three
processes: rank 0 decides between points, every rank joins the broadcast at each point,
and all act at the same commit; a stranger's value in a store plays no part."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elastic.contract.errors import PeerDataInvalid
from elastic.worker.switch_points import SwitchPoints, decision_words, read_decision


@pytest.mark.parametrize("decided, commits, expected", [
    (None, 3, None),
    ((8, "switch"), 4, (8, "switch")),
    ((8, "stop"), 8, (8, "stop")),
])
def test_decisions_round_trip(decided, commits, expected):
    assert read_decision(decision_words(decided), commits) == expected


@pytest.mark.parametrize("words", [[3, 1], [8, 3], [8, -1]])
def test_an_impossible_decision_from_rank_0_is_a_ring_fault(words):
    with pytest.raises(PeerDataInvalid):
        read_decision(words, 4)


_RANK = r"""
import datetime, sys, torch.distributed as dist
from elastic.worker.switch_points import SwitchPoints, agree, ring_exchange
rank, path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", store=dist.FileStore(path, 3), rank=rank, world_size=3,
                        timeout=datetime.timedelta(seconds=30))
points, switch, wants = SwitchPoints(), None, False
points.agree(0, 0.1)  # every 2 commits from 0 (0.25 s at 0.1 s a commit)
for commits in range(1, 20):
    wants = wants or (rank == 0 and commits == 5)  # rank 0 sees a reason between points
    if points.is_point(commits) and switch is None:
        switch = agree((commits, "switch") if wants else None, commits, rank, ring_exchange)
    if switch is not None and commits >= switch[0]:
        print(f"{switch[1]} at {commits}", flush=True)
        break
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_every_rank_acts_at_the_commit_rank_0_decided(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(rank), str(tmp_path / "store")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(3)]
    results = [proc.communicate(timeout=100) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0], [err[-1500:] for _, err in results]
    assert [out.strip() for out, _ in results] == ["switch at 6"] * 3
