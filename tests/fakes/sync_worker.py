"""One worker of a real gloo ring that syncs an ``elastic.State`` (tests of State.sync).

    python -m tests.fakes.sync_worker RANK WORLD STORE_PORT SCENARIO [--backend nccl]

The value v of the state is: weights all v, counts all v, step v. Each rank first
commits what SCENARIO gives it (the round each commit is made in, and its value),
then all sync; each rank prints one JSON line: what it holds after the sync (and,
if the sync broke, after ``restore()``, as ``@elastic.run`` does next), and what
reached it through ``torch.distributed`` during the sync ("received": bytes per
call name), so that a test sees a holder that receives anything.

    mixed        ranks 0, 1: commits 1, 2 in round 2 (value 2, the newest)
                 rank 2: commits 1, 2, 3 in round 1 (value 3: a higher count, an older history)
                 rank 3: no commit (a joiner)
    holder-dies  rank 0: commits up to 4 in round 1 (value 4); ranks 1, 2: up to 3 (value 3);
                 rank 0 exits after sending 2 of its chunks: the receivers keep commit 3
    laggard      rank 0: commits 1, 2 (value 2); every other rank: commit 1 (value 1)
    rank0-behind rank 0: commit 1 (value 1); ranks 1, 2: commits 1, 2 (value 2); rank 3: no
                 commit (a joiner): rank 0 receives, and the layout comes from rank 1

With ``--backend nccl`` the state lives on GPU ``RANK`` (the staged transfer path).
"""

import argparse
import datetime
import json
import os
import torch
import torch.distributed as dist

import elastic
from elastic import state as state_module
from elastic.worker import lifecycle, state_transfer
from elastic.worker.session import WorkerSession
from tests.fakes.ring import FakeRing

p = argparse.ArgumentParser()
p.add_argument("rank", type=int)
p.add_argument("world", type=int)
p.add_argument("port", type=int)
p.add_argument("scenario", choices=["mixed", "holder-dies", "laggard", "rank0-behind"])
p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
args = p.parse_args()
device = torch.device("cpu")
if args.backend == "nccl":
    torch.cuda.set_device(args.rank)
    device = torch.device("cuda", args.rank)

store = dist.TCPStore("127.0.0.1", args.port, is_master=False, timeout=datetime.timedelta(seconds=30))
dist.init_process_group(args.backend, store=store, rank=args.rank, world_size=args.world,
                        timeout=datetime.timedelta(seconds=15))
# The ring as State sees it: rank, world, round, backend; no checkpoint policy.
ring = FakeRing(rank=args.rank, world_size=args.world, backend=args.backend, round=1)
lifecycle.install(WorkerSession.serving(ring))
# Two dtypes: two flat buffers. Small chunks: a sync of 4 MB is many transfers.
state_transfer.CHUNK_BYTES = state_module.CHUNK_BYTES = 256 << 10
state = elastic.State(weights=torch.zeros(1 << 20, device=device), counts=torch.zeros(10, dtype=torch.int64, device=device),
                      step=0)


def commit_values(round_number: int, values) -> None:
    ring.round = round_number
    for value in values:
        state.weights = torch.full((1 << 20,), float(value), device=device)
        state.counts = torch.full((10,), value, dtype=torch.int64, device=device)
        state.step = value
        state.commit()


def describe() -> dict:
    commit = state.commit_id
    return {"rank": args.rank, "weights": sorted(set(state.weights.tolist())),
            "counts": sorted(set(state.counts.tolist())), "step": state.step,
            "commit": None if commit is None else [commit.round, commit.count]}


if args.scenario == "mixed":
    if args.rank in (0, 1):
        commit_values(2, [1, 2])
    elif args.rank == 2:
        commit_values(1, [1, 2, 3])
elif args.scenario == "laggard":
    commit_values(1, [1, 2] if args.rank == 0 else [1])
elif args.scenario == "rank0-behind":
    if args.rank < 3:
        commit_values(1, [1] if args.rank == 0 else [1, 2])
else:
    commit_values(1, [1, 2, 3, 4] if args.rank == 0 else [1, 2, 3])
    if args.rank == 0:
        def send_some_then_die(plan, rank, buffers, backend):
            for tag, transfer in list(state_transfer._tagged(plan.sends(rank), True))[:2]:
                view = buffers[transfer.buffer].narrow(0, transfer.start, transfer.length)
                dist.send(view, dst=transfer.receiver, tag=tag)
            os._exit(0)  # the only holder is lost in the middle of the sync

        state_module.run_transfers = send_some_then_die
    ring.round = 2

received: dict = {}


def _nbytes(tensors) -> int:
    tensors = tensors if isinstance(tensors, (list, tuple)) else [tensors]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def count_received(name: str, original):
    """Wrap ``dist.<name>`` to add what it brings to this rank to ``received[name]``
    (the sync calls ``dist.<name>`` through the module, so the wrapper sees every call)."""
    def wrapper(*a, **kw):
        src = kw.get("src", a[1] if len(a) > 1 and name in ("broadcast", "broadcast_object_list") else None)
        if name in ("broadcast", "broadcast_object_list") and src == args.rank:
            got = 0  # the source of a broadcast receives nothing
        elif name == "broadcast_object_list":
            got = 1  # an object's size is unknown before the call: count the call
        elif name in ("all_gather", "all_gather_object"):
            got = _nbytes(kw.get("tensor_list", a[0] if a else [])) if name == "all_gather" else 1
        else:
            got = _nbytes(kw.get("tensor", a[0] if a else None))
        received[name] = received.get(name, 0) + got
        return original(*a, **kw)
    return wrapper


for _name in ("broadcast", "broadcast_object_list", "recv", "irecv", "all_gather", "all_gather_object",
              "all_reduce", "scatter", "scatter_object_list", "reduce", "barrier", "all_to_all",
              "all_to_all_single", "reduce_scatter", "batch_isend_irecv"):
    setattr(dist, _name, count_received(_name, getattr(dist, _name)))

# Every rank syncs in the same round, after every round its commits were made in (a
# commit of a later round than the current one is a claim the sync refuses).
ring.round = 3 if args.scenario == "mixed" else 2
outcome = "synced"
try:
    plan = state.sync(ring)
    outcome = f"synced: holders {list(plan.holders)} receivers {list(plan.receivers)}"
except Exception as exc:  # noqa: BLE001 - a broken ring: what @elastic.run does next is restore()
    outcome = f"failed: {type(exc).__name__}"
    state.restore()
print(json.dumps({"outcome": outcome, **describe(), "received": received}), flush=True)
os._exit(0)  # no teardown of a ring that may have lost a rank
