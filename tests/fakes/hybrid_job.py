"""A small deterministic HSDP job (elastic.HybridShardedState) for the hybrid-sharding tests.

Float64. Four FSDP units (three Linear layers, then the root), AdamW, a StepLR, gradient
clipping. Step ``t`` trains on global batch ``t`` of a fixed synthetic data set; each
training worker takes rows ``index::count`` of it (``state.data_share``: spares take
none, tensor-parallel peers share one) with its loss scaled by ``count``, so FSDP2's
averaging gives the gradient of the whole batch's mean loss: the result equals
``--reference`` (one process, no FSDP, no elastic) whatever the ring does.

With ``--tp 2`` each group is shard 1 x tp 2: the Linear layers are tensor-parallel
(column, row, column with a replicated output), then fully sharded over ("replicate", "shard").

Files written to --out:
  pids.jsonl     {"pid", "rank", "round", "world", "mesh"} at every entry of the training function
  steps.jsonl    {"pid", "rank", "world", "round", "step", "lr", "share"} per trained step
  final.pt       the lead's full parameters at the end, or the reference run's
  killed-<step>  written right before a --kill-at kill
"""

import argparse
import json
import os
import signal
import time

import torch
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=12)
p.add_argument("--global-batch", type=int, default=12)
p.add_argument("--shard-size", type=int, default=None)
p.add_argument("--min-groups", type=int, default=2)
p.add_argument("--tp", type=int, default=1)
p.add_argument("--step-delay", type=float, default=0.0)
p.add_argument("--kill-at", action="append", default=[], metavar="RANK:STEP[:host]",
               help="rank RANK SIGKILLs itself after training step STEP (once per job); ':host' takes its agent too")
p.add_argument("--hold-at", action="append", default=[], metavar="STEP:WORLD",
               help="once STEP is trained, hold (steps of zero rows, no update) until the ring has WORLD workers")
p.add_argument("--stall-at", type=int, default=None, help="once this step is trained, hold for good (a total loss)")
p.add_argument("--reference", action="store_true")
p.add_argument("--out", required=True)
args = p.parse_args()

torch.set_default_dtype(torch.float64)
os.makedirs(args.out, exist_ok=True)
gen = torch.Generator().manual_seed(1234)
ROWS = max(args.steps, 100) * args.global_batch
X = torch.randn(ROWS, 7, generator=gen)
Y = torch.randn(ROWS, 3, generator=gen)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(7, 10), nn.Linear(10, 13), nn.Linear(13, 3)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def build() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def shard(model, mesh):
    from torch.distributed.fsdp import fully_shard

    if mesh.ndim == 3:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        # Every parameter on the one 3-D mesh: clip_grad_norm_ stacks their norms.
        parallelize_module(model, mesh["tp"], {"a": ColwiseParallel(), "b": RowwiseParallel(),
                                               "c": ColwiseParallel(output_layouts=Replicate())})
        mesh = mesh["replicate", "shard"]
    for layer in (model.a, model.b, model.c):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def make_optimizer(module):
    return torch.optim.AdamW(module.parameters(), lr=0.01, weight_decay=0.1)


def make_scheduler(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)


def append(name, record):
    with open(os.path.join(args.out, name), "a") as f:
        f.write(json.dumps(record) + "\n")


def rows_of(step, index, count):
    start = step * args.global_batch
    return torch.arange(start, start + args.global_batch)[index::count]


def train_step(model, optimizer, scheduler, step, index, count):
    rows = rows_of(step, index, count)
    loss = ((model(X[rows]) - Y[rows]) ** 2).sum() * count / args.global_batch
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    return lr


if args.reference:
    model = build()
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer)
    for step in range(args.steps):
        lr = train_step(model, optimizer, scheduler, step, 0, 1)
        append("reference.jsonl", {"step": step + 1, "lr": lr})
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(args.out, "final.pt"))
    raise SystemExit(0)

import elastic  # noqa: E402

elastic.init()
state = elastic.HybridShardedState(model=build, optimizer=make_optimizer, scheduler=make_scheduler, shard=shard,
                                   shard_size=args.shard_size, tensor_parallel=args.tp, min_groups=args.min_groups,
                                   step=0)
KILLS = []
for spec in args.kill_at:
    rank, at, *host = spec.split(":")
    KILLS.append((int(rank), int(at), bool(host)))
HOLDS = [tuple(int(v) for v in spec.split(":")) for spec in args.hold_at]


def maybe_die(step):
    for rank, at, host in KILLS:
        if step != at or elastic.rank() != rank:
            continue
        marker = os.path.join(args.out, f"killed-{step}")
        if os.path.exists(marker):
            return
        with open(marker, "w") as f:
            f.write(str(elastic.round()))
        if host:
            os.kill(int(os.environ["ELASTIC_WORKER_AGENT_PID"]), signal.SIGKILL)  # not our parent: a template
        os.kill(os.getpid(), signal.SIGKILL)


def holding(step, world):
    if args.stall_at is not None and step >= args.stall_at:
        return True
    return any(step == at and world < until for at, until in HOLDS)


@elastic.run
def train(state):
    rank, world = elastic.rank(), elastic.size()
    plan = state.mesh_plan
    index, count = state.data_share
    append("pids.jsonl", {"pid": os.getpid(), "rank": rank, "round": elastic.round(), "world": world,
                          "mesh": plan.describe()})
    model, optimizer, scheduler = state.model, state.optimizer, state.scheduler
    if plan.mode == "hybrid":  # the user's view of the round's mesh is the one the state trains on
        dims = ("replicate", "shard", "tp") if args.tp > 1 else ("replicate", "shard")
        mesh = elastic.device_mesh(dims)
        expected = (len(plan.groups), plan.shape.shard_size) + ((args.tp,) if args.tp > 1 else ())
        assert tuple(mesh.shape) == expected and mesh.mesh_dim_names == dims, (mesh, expected)
    while state.step < args.steps:
        if holding(state.step, world):
            # A step of no rows and no update: its collectives keep the ring in lockstep.
            model(X[:0]).sum().backward()
            optimizer.zero_grad()
            time.sleep(0.05)
            state.commit()
            continue
        lr = train_step(model, optimizer, scheduler, state.step, index, count)
        maybe_die(state.step + 1)
        state.step += 1
        append("steps.jsonl", {"pid": os.getpid(), "rank": rank, "world": world, "round": elastic.round(),
                               "step": state.step, "lr": lr, "share": [index, count]})
        time.sleep(args.step_delay)
        state.commit()
    full = {name: value.full_tensor() for name, value in state.model.state_dict().items()}
    if rank == plan.training[0]:
        torch.save(full, os.path.join(args.out, "final.pt"))


train(state)
