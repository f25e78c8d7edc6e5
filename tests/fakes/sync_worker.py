"""One worker of a real gloo ring that syncs an ``elastic.State`` (tests of State.sync).

    python -m tests.fakes.sync_worker RANK WORLD STORE_PORT [--die-after-buffers N]

Every rank commits (``save``) the value 1 and then the value 3 through two syncs
from rank 0; then rank 0 changes its state to 4 and starts a third sync. With
``--die-after-buffers N`` rank 0 exits after sending the layout and N buffers of
that third sync. Each surviving rank prints one JSON line: what ``restore()`` gives
after the sync failed (or what the sync delivered when it did not fail).
"""

import argparse
import datetime
import json
import os
import types

import torch
import torch.distributed as dist

import elastic
from elastic import state as state_module

p = argparse.ArgumentParser()
p.add_argument("rank", type=int)
p.add_argument("world", type=int)
p.add_argument("port", type=int)
p.add_argument("--die-after-buffers", type=int, default=None)
args = p.parse_args()

store = dist.TCPStore("127.0.0.1", args.port, is_master=False, timeout=datetime.timedelta(seconds=30))
dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world,
                        timeout=datetime.timedelta(seconds=15))
# The runtime as State sees it: rank, world, backend; no checkpoint policy.
elastic._current = types.SimpleNamespace(rank=args.rank, world_size=args.world, backend="gloo",
                                         config=None, round=1)
# Two dtypes: two flat buffers, so a sync can stop between them.
state = elastic.State(weights=torch.zeros(1000), counts=torch.zeros(10, dtype=torch.int64), step=0)


def set_everything(value: int) -> None:
    state.weights = torch.full((1000,), float(value))
    state.counts = torch.full((10,), value, dtype=torch.int64)
    state.step = value


def describe() -> dict:
    return {"rank": args.rank, "weights": sorted(set(state.weights.tolist())),
            "counts": sorted(set(state.counts.tolist())), "step": state.step}


for value in (1, 3):  # two complete syncs: the second reuses what the first received
    if args.rank == 0:
        set_everything(value)
    state.sync()
    assert describe()["weights"] == [float(value)] and state.step == value, describe()

if args.rank == 0 and args.die_after_buffers is not None:
    sent = []
    real_broadcast = state_module._broadcast_from_rank0

    def broadcast_then_die(buffer, backend):
        if len(sent) == args.die_after_buffers:
            os._exit(0)  # rank 0 is lost in the middle of the sync
        real_broadcast(buffer, backend)
        sent.append(buffer.numel())

    state_module._broadcast_from_rank0 = broadcast_then_die

if args.rank == 0:
    set_everything(4)
outcome = "synced"
try:
    state.sync()
except Exception as exc:  # noqa: BLE001 - a broken ring: what @elastic.run does next is restore()
    outcome = f"failed: {type(exc).__name__}"
    state.restore()
print(json.dumps({"outcome": outcome, **describe()}), flush=True)
os._exit(0)  # no teardown of a ring that lost its rank 0
