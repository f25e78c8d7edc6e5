"""A small deterministic FSDP2 job (elastic.ShardedState) for the sharded integration tests.

Float64 throughout. Step ``t`` trains on global batch ``t`` of a fixed synthetic data set;
rank r of W takes rows r::W with a loss scaled so that FSDP2's averaging of gradients
over the ring gives exactly the gradient of the whole batch's mean loss: the result
equals ``--reference`` (one process, no FSDP, no elastic) whatever the ring does.
Layer widths 7, 10, 13 divide by no world of 2, 3 or 4.

Files written to --out:
  pids.jsonl     {"pid", "rank", "round", "world"} at every (re-)entry
  steps.jsonl    {"pid", "rank", "world", "round", "step"} per completed step
  final.pt       rank 0's full parameters at the end (gathered), or the reference run's
  killed-<step>  written by --kill-rank (or --kill-at) right before it SIGKILLs itself
  builds.jsonl   {"pid", "device"} each time build() runs: "meta" unless it built the whole model
"""

import argparse
import json
import os
import signal
import time

import torch
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=30)
p.add_argument("--global-batch", type=int, default=12)
p.add_argument("--step-delay", type=float, default=0.0)
p.add_argument("--kill-rank", default=None, help="these ranks (comma-separated) SIGKILL themselves (once per job) ...")
p.add_argument("--kill-step", type=int, default=None, help="... after training this step, before committing it")
p.add_argument("--kill-agent", action="store_true", help="... and takes its agent (its parent) with it: a host dies")
p.add_argument("--kill-at", action="append", default=[], metavar="RANKS:STEP",
               help="one more kill like --kill-rank/--kill-step (repeatable, each once per job), e.g. 2:3 then 0:6")
p.add_argument("--hold-below-world", type=int, default=None,
               help="before the first step, commit without training while the ring is smaller")
p.add_argument("--grow-back", action="store_true",
               help="after the last kill, commit without training until the ring is --hold-below-world again")
p.add_argument("--hold-from-step", type=int, default=None,
               help="once this step is committed, commit without training until the ring has --hold-until-world")
p.add_argument("--hold-until-world", type=int, default=None)
p.add_argument("--init", action="store_true",
               help="ShardedState(init=...): no rank builds the whole model, each initialises its own rows "
               "from a formula of the global row (the reference builds the same values whole)")
p.add_argument("--load-dcp", default=None, help="a plain FSDP2 script (torchrun): load this DCP checkpoint, "
               "write the full parameters to final.pt")
p.add_argument("--reference", action="store_true", help="one process, plain module and optimizer")
p.add_argument("--scheduler", action="store_true", help="a StepLR built from the optimizer (ShardedState(scheduler=...)); "
               "steps.jsonl (reference.jsonl with --reference) logs each step's learning rate")
p.add_argument("--out", required=True)
args = p.parse_args()

torch.set_default_dtype(torch.float64)
os.makedirs(args.out, exist_ok=True)
gen = torch.Generator().manual_seed(1234)
ROWS = max(args.steps, 100) * args.global_batch  # the same data whatever --steps says (a resumed run)
X = torch.randn(ROWS, 7, generator=gen)
Y = torch.randn(ROWS, 3, generator=gen)


def build() -> nn.Module:
    if not args.reference:  # which device the factory builds on: "meta" unless a whole model
        append("builds.jsonl", {"pid": os.getpid(), "device": torch.empty(0).device.type})
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 10), nn.Tanh(), nn.Linear(10, 13), nn.Tanh(), nn.Linear(13, 3))


def init_values(index, shape, start, end):
    """Rows [start, end) of parameter number ``index`` (of ``shape``) under --init: a formula
    of the global row and column, so no rank needs the whole tensor to compute its rows."""
    rows = torch.arange(start, end, dtype=torch.float64)
    grid = rows if len(shape) == 1 else rows[:, None] * 0.73 + torch.arange(shape[1], dtype=torch.float64) * 1.37
    return 0.4 * torch.sin(grid + 0.5 * index + 0.1)


def init_shards(module):
    """ShardedState's init=: each rank fills its own rows (FSDP2 shards dim 0, torch.chunk's rule)."""
    from torch.distributed.tensor import Shard

    with torch.no_grad():
        for index, (name, param) in enumerate(module.named_parameters()):
            assert tuple(param.placements) == (Shard(0),), (name, param.placements)
            world, rank, rows = param.device_mesh.size(), param.device_mesh.get_local_rank(), param.shape[0]
            per = -(-rows // world)
            start, end = min(rows, rank * per), min(rows, (rank + 1) * per)
            local = param.to_local()
            assert local.shape[0] == end - start, (name, local.shape, start, end)
            local.copy_(init_values(index, param.shape, start, end))


def init_whole(module):
    """The reference's --init: the same values, every row."""
    with torch.no_grad():
        for index, (_, param) in enumerate(module.named_parameters()):
            param.copy_(init_values(index, param.shape, 0, param.shape[0]))


def make_optimizer(module):
    return torch.optim.Adam(module.parameters(), lr=0.01)


def make_scheduler(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)


def append(name, record):
    with open(os.path.join(args.out, name), "a") as f:
        f.write(json.dumps(record) + "\n")


def rows_of(step, rank, world):
    start = step * args.global_batch
    return torch.arange(start, start + args.global_batch)[rank::world]


if args.reference:
    model = build()
    if args.init:
        init_whole(model)
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer) if args.scheduler else None
    for step in range(args.steps):
        rows = rows_of(step, 0, 1)
        loss = ((model(X[rows]) - Y[rows]) ** 2).sum() / args.global_batch
        loss.backward()
        append("reference.jsonl", {"step": step + 1, "lr": optimizer.param_groups[0]["lr"]})
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(args.out, "final.pt"))
    raise SystemExit(0)

import torch.distributed as dist  # noqa: E402

if args.load_dcp:  # what a user does elsewhere with a checkpoint of elastic-run: nothing of elastic
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = make_optimizer(model)
    msd, osd = get_state_dict(model, optimizer)
    loaded = {"model": msd, "optim": osd}
    dcp.load(loaded, checkpoint_id=args.load_dcp)
    set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    full = {name: value.full_tensor() for name, value in model.state_dict().items()}
    if dist.get_rank() == 0:
        torch.save(full, os.path.join(args.out, "final.pt"))
    dist.destroy_process_group()
    raise SystemExit(0)

import elastic  # noqa: E402

elastic.init()
state = elastic.ShardedState(model=build, optimizer=make_optimizer, init=init_shards if args.init else None,
                             scheduler=make_scheduler if args.scheduler else None, step=0)

KILLS = [(args.kill_rank.split(","), args.kill_step)] if args.kill_rank is not None else []
for spec in args.kill_at:
    ranks, _, at = spec.partition(":")
    KILLS.append((ranks.split(","), int(at)))
LAST_KILL = max((at for _, at in KILLS), default=None)


def maybe_die(step):
    if not any(step == at and str(elastic.rank()) in ranks for ranks, at in KILLS):
        return
    marker = os.path.join(args.out, f"killed-{step}")
    if os.path.exists(marker) and elastic.round() != int(open(marker).read() or 0):
        return
    with open(marker, "w") as f:  # several ranks of one round may die at this step
        f.write(str(elastic.round()))
    if args.kill_agent:
        os.kill(int(os.environ["ELASTIC_WORKER_AGENT_PID"]), signal.SIGKILL)  # not our parent: a template
    os.kill(os.getpid(), signal.SIGKILL)


@elastic.run
def train(state):
    rank, world = elastic.rank(), elastic.size()
    append("pids.jsonl", {"pid": os.getpid(), "rank": rank, "round": elastic.round(), "world": world})
    model, optimizer = state.model, state.optimizer
    while state.step < args.steps:
        killed = os.path.exists(os.path.join(args.out, f"killed-{LAST_KILL}"))
        held = args.hold_from_step is not None and state.step >= args.hold_from_step and world != args.hold_until_world
        if held or args.hold_below_world and world < args.hold_below_world and (
                state.step == 0 or args.grow_back and killed):
            dist.barrier()
            time.sleep(0.05)
            state.commit()
            continue
        rows = rows_of(state.step, rank, world)
        # FSDP2 averages gradients over the ring: scale so the sum is the batch's mean.
        loss = ((model(X[rows]) - Y[rows]) ** 2).sum() * world / args.global_batch
        loss.backward()
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        optimizer.zero_grad()
        if state.scheduler is not None:
            state.scheduler.step()
        maybe_die(state.step + 1)
        state.step += 1
        append("steps.jsonl", {"pid": os.getpid(), "rank": rank, "world": world, "round": elastic.round(),
                               "step": state.step, "lr": lr})
        time.sleep(args.step_delay)
        state.commit()
    full = {name: value.full_tensor() for name, value in state.model.state_dict().items()}
    if rank == 0:
        torch.save(full, os.path.join(args.out, "final.pt"))


train(state)
