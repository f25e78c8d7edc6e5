"""A small, fully deterministic elastic training job for the integration tests.

Each step uses the global batch ``step`` of a fixed synthetic data set; rank r
takes rows r::world of it, so with a mean loss and DDP's gradient averaging the
result equals single-process training on the whole global batch. With --epochs
the ElasticSampler picks the rows instead: 4 per rank, or with --global-batch-size
G each step is the sampler's next global batch of G (a sum loss times loss_scale).

Files written to --out (one line per event, flushed at once, so tests can watch):
  pids.jsonl      {"pid", "rank", "round", "world"} at every (re-)entry
  steps.jsonl     {"pid", "rank", "world", "round", "step", "indices", "t"} per completed step
                  (sampler mode adds "batch": the whole global batch of the step, every
                  rank's indices, so the step is accounted for even if only one rank logs it)
  final-<pid>.pt  the final parameters (float64 when --float64)
  hung.jsonl      {"pid", "rank", "step", "time"} when --hang-rank's main thread starts sleeping forever
  gil.jsonl       {"pid", "seconds", "time"} when TRAIN_JOB_SETUP_HOLDS_GIL=S makes the set-up keep the GIL S seconds
  killed-<step>   written by --kill-rank right before it SIGKILLs itself (--kill-at: once per job and step)
  committed-<step> written by rank 0 after its commit of a step that --kill-at names
  lagged-<step>   written by --lag-rank (its pid) when it leaves the step uncommitted
  slots.jsonl     with --record-slots: {"pid", "rank", "round", "local_rank", "env_local_rank",
                  "local_world_size"} at every (re-)entry
  accelerator-error-<step>  written (its pid) by --accelerator-error-rank right before it raises
  device-stall-<step>  written ({"pid", "time"}) by --device-stall-rank right before it queues its device sleep
  oom-<pid>       written (its time) by each rank right before it raises OutOfMemoryError (--oom-step)
  exit0-<step>    written (its pid) by --exit0-rank right before it calls os._exit(0) (once per job)
  barrier.jsonl   {"pid", "round", "where"} by every worker whose --setup-barrier returned
"""

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import elastic
from elastic.worker import lifecycle

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=50)
p.add_argument("--commit-every", type=int, default=1)
p.add_argument("--step-delay", type=float, default=0.0)
p.add_argument("--extra-step-delay", type=float, default=float(os.environ.get("TRAIN_JOB_EXTRA_STEP_DELAY", 0)),
               help="sleep this much more per step (a straggler); from the environment, it slows one host's "
                    "workers whatever their ranks")
p.add_argument("--slow-factor", type=float, default=float(os.environ.get("TRAIN_JOB_SLOW_FACTOR", 1)),
               help="a straggler whose steps take this many times as long (from the environment too): after "
                    "each step it sleeps (F - 1) times what the step took, so a loaded machine, which lengthens "
                    "every worker's steps, leaves the ratio F where a fixed sleep would shrink it")
p.add_argument("--global-batch", type=int, default=32)
p.add_argument("--float64", action="store_true")
p.add_argument("--fail-rank", type=int, default=None)
p.add_argument("--fail-step", type=int, default=None)
p.add_argument("--epochs", type=int, default=0, help="sampler mode: epochs over --dataset-size samples")
p.add_argument("--dataset-size", type=int, default=240)
p.add_argument("--global-batch-size", type=int, default=None,
               help="sampler mode: batches(global_batch_size=G), a sum loss times loss_scale")
p.add_argument("--max-steps", type=int, default=None, help="sampler mode: stop after this many steps")
p.add_argument("--micro-batch-size", type=int, default=None, help="... each share as micro-batches of at most M")
p.add_argument("--slow-rank", type=int, default=None, help="this rank stalls once, mid-step (grace tests)")
p.add_argument("--slow-step", type=int, default=None, help="... in the first step >= this it runs, between finishing and committing it")
p.add_argument("--slow-delay", type=float, default=0.0)
p.add_argument("--slow-round", type=int, default=None, help="... only in this round (a new rank 0 does not stall)")
p.add_argument("--wait-file", default=None, help="every rank waits (bounded) after logging --wait-step until "
               "this file exists: a test acts at a known step without racing the job")
p.add_argument("--wait-step", type=int, default=None)
p.add_argument("--hang-rank", type=int, default=None, help="this rank's main thread sleeps forever ...")
p.add_argument("--hang-step", type=int, default=None, help="... after finishing this step, outside any collective")
p.add_argument("--break-ring-every", type=int, default=None,
               help="steps mode: after every Nth commit, the last rank shuts its ring's connections down, as a "
                    "network fault would: the whole ring takes the failure path (abort, restore, re-form, sync)")
p.add_argument("--hold-below-world", type=int, default=None,
               help="while the ring is smaller than this, commit in lockstep without training")
p.add_argument("--hold-from-step", type=int, default=0,
               help="--hold-below-world holds only from this step on (a ring that trains until a "
                    "joiner is started, then waits for it however slowly it starts)")
p.add_argument("--kill-at", default="", help="STEP:POINT,... --kill-rank SIGKILLs itself at POINT "
               "of step STEP: before-step, mid-step (after the forward, before the all-reduce), "
               "before-commit, after-peer-commit (once rank 0 has committed the step), after-commit; "
               "without --epochs: after-allreduce (the step trained, not yet recorded)")
p.add_argument("--kill-rank", type=int, default=1)
p.add_argument("--lag-rank", type=int, default=None,
               help="at the step of the after-peer-commit kill, this rank does not commit before the kill: it "
                    "waits (bounded) until --kill-rank is gone, then goes on to the next step's collectives, "
                    "which fail; so at the kill rank 0 holds the step's commit and this rank one commit less")
p.add_argument("--stop-file", default=None, help="stop (all ranks at one step) once this file exists")
p.add_argument("--accelerator-error-rank", type=int, default=None,
               help="this rank raises torch.AcceleratorError (a sticky CUDA error, as on an illegal address) ...")
p.add_argument("--accelerator-error-step", type=int, default=None,
               help="... at this step, once per job (a marker file: its replacement trains on)")
p.add_argument("--device-stall-rank", type=int, default=0,
               help="with --device cuda: this rank queues a device-side sleep (once per job) ...")
p.add_argument("--device-stall-step", type=int, default=None, help="... before the all-reduce of this step ...")
p.add_argument("--device-stall-s", type=float, default=0.0, help="... of at least this many seconds (gpu review "
               "section 4: a collective stalled on the device, a hung device)")
p.add_argument("--oom-step", type=int, default=None,
               help="every rank raises torch.OutOfMemoryError at this step (a batch that does not fit)")
p.add_argument("--exit0-rank", type=int, default=None, help="this rank calls os._exit(0) mid-training ...")
p.add_argument("--exit0-step", type=int, default=None, help="... at this step, once per job")
p.add_argument("--record-slots", action="store_true", help="slots.jsonl: {pid, rank, round, local_rank, "
               "env_local_rank, local_world_size} at every (re-)entry: a worker's device slot through rounds")
p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
               help="where the model and batches live; cuda: the GPU of the worker's LOCAL_RANK (modulo the "
                    "visible GPUs, so several workers can share one through gloo)")
p.add_argument("--setup-barrier", choices=("before", "inside"), default=None, help="\"rank 0 downloads, then "
               "dist.barrier()\": before train(state), outside the decorated function, or first thing inside it")
p.add_argument("--out", required=True)
args = p.parse_args()

dtype = torch.float64 if args.float64 else torch.float32
torch.set_default_dtype(dtype)
elastic.init()
os.makedirs(args.out, exist_ok=True)


def append(name, record):
    with open(os.path.join(args.out, name), "a") as f:
        f.write(json.dumps(record) + "\n")


def sleep_holding_the_gil(seconds: int) -> None:
    """A set-up stuck in C code that keeps the GIL (a library's deadlock): no other
    Python thread runs meanwhile, the heartbeat neither, and every thread sleeps."""
    import ctypes

    append("gil.jsonl", {"pid": os.getpid(), "seconds": seconds, "time": time.time()})
    ctypes.PyDLL(None).sleep(seconds)  # PyDLL: the call keeps the GIL


if os.environ.get("TRAIN_JOB_SETUP_HOLDS_GIL"):  # for one agent's workers only: set in its environment
    sleep_holding_the_gil(int(os.environ["TRAIN_JOB_SETUP_HOLDS_GIL"]))


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
device = torch.device("cpu")
if args.device == "cuda":
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    model.to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
gen = torch.Generator().manual_seed(1234)
X = torch.randn(max(args.steps * args.global_batch, args.dataset_size), 16, generator=gen)
Y = torch.randint(0, 4, (X.shape[0],), generator=gen)
sampler = elastic.ElasticSampler(args.dataset_size, shuffle=True, seed=7) if args.epochs else None
state = elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, step=0, epoch=0)


def one_step(ddp, rows):
    loss = F.cross_entropy(ddp(X[rows].to(device)), Y[rows].to(device))
    state.optimizer.zero_grad()
    loss.backward()
    state.optimizer.step()


def global_batch_step(ddp, rows):
    """One step on this rank's share of the global batch; returns the indices it used."""
    micro_batches = rows if args.micro_batch_size else [rows]
    state.optimizer.zero_grad()
    for micro in elastic.accumulate(ddp, micro_batches):
        micro = torch.tensor(micro, dtype=torch.long)  # may be empty: a short last batch
        loss = F.cross_entropy(ddp(X[micro].to(device)), Y[micro].to(device), reduction="sum") * state.sampler.loss_scale
        maybe_die("mid-step", state.step + 1)  # after the forward, before the gradients' all-reduce
        loss.backward()
    state.optimizer.step()
    return [i for micro in micro_batches for i in micro]


def record_step(indices, batch=None):
    record = {"pid": os.getpid(), "rank": elastic.rank(), "world": elastic.size(),
              "round": elastic.round(), "step": state.step, "epoch": state.epoch, "t": time.time(),
              "indices": indices}
    if batch is not None:
        record["batch"] = batch
    append("steps.jsonl", record)
    if state.step == args.hang_step and elastic.rank() == args.hang_rank \
            and not os.path.exists(os.path.join(args.out, "hung.jsonl")):  # once per job
        sleep_forever()
    if state.step == args.wait_step and args.wait_file is not None:
        deadline = time.monotonic() + 300
        while not os.path.exists(args.wait_file) and time.monotonic() < deadline:
            time.sleep(0.01)
    if args.slow_step is not None and state.step >= args.slow_step and elastic.rank() == args.slow_rank \
            and args.slow_round in (None, elastic.round()) and not stalled:
        stalled.append(state.step)  # once per process
        time.sleep(args.slow_delay)


stalled: list = []
kill_points = dict(reversed(item.split(":")) for item in args.kill_at.split(",") if item)  # point -> step


def maybe_die(point: str, step: int) -> None:
    """--kill-at: SIGKILL this worker at ``point`` of ``step`` (once per job: a marker file)."""
    if kill_points.get(point) != str(step) or elastic.rank() != args.kill_rank:
        return
    marker = os.path.join(args.out, f"killed-{step}")
    if os.path.exists(marker):
        return
    if point == "after-peer-commit":  # wait (bounded) until rank 0 has made the commit we have not
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(args.out, f"committed-{step}")) and time.monotonic() < deadline:
            time.sleep(0.01)
    open(marker, "w").close()
    os.kill(os.getpid(), signal.SIGKILL)


def lags(step: int) -> bool:
    """--lag-rank: True (once per job) when this rank leaves ``step`` uncommitted, after the kill."""
    if elastic.rank() != args.lag_rank or kill_points.get("after-peer-commit") != str(step):
        return False
    marker = os.path.join(args.out, f"lagged-{step}")
    if os.path.exists(marker):
        return False
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(args.out, f"killed-{step}")) and time.monotonic() < deadline:
        time.sleep(0.01)
    with open(marker, "w") as f:  # the test finds this worker's reform_done by its pid
        f.write(str(os.getpid()))
    return True


def commit_marked(step: int) -> None:
    """state.commit(); rank 0 then leaves a marker when --kill-at waits for its commit of ``step``."""
    if lags(step):
        return
    try:
        state.commit()
    finally:
        if elastic.rank() == 0 and str(step) in kill_points.values():
            open(os.path.join(args.out, f"committed-{step}"), "w").close()


def sleep_forever():
    """A main thread stuck outside any collective (a deadlock, a dead data source)."""
    append("hung.jsonl", {"pid": os.getpid(), "rank": elastic.rank(), "step": state.step, "time": time.time()})
    while True:
        time.sleep(1)


def maybe_stall_the_device(step: int) -> None:
    """--device-stall-*: queue a device sleep, so the step's all-reduce waits behind it (the
    host returns at once; only the device, then NCCL's watchdog or a sync, sees it)."""
    if step != args.device_stall_step or elastic.rank() != args.device_stall_rank or device.type != "cuda":
        return
    marker = os.path.join(args.out, f"device-stall-{step}")
    if os.path.exists(marker):
        return
    with open(marker, "w") as f:
        json.dump({"pid": os.getpid(), "time": time.time()}, f)
    # _sleep counts clock cycles; 2e9 per second is at or above an H100's boost clock, so
    # the stall lasts at least --device-stall-s.
    torch.cuda._sleep(int(args.device_stall_s * 2e9))


def told_to_stop() -> bool:
    """Rank 0 looks for --stop-file and tells the ring, so every rank stops at the same step."""
    if args.stop_file is None:
        return False
    flag = torch.tensor([1 if elastic.rank() == 0 and os.path.exists(args.stop_file) else 0])
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def hold_until_the_ring_grows():
    """Wait for a joiner at commits (where a grow is applied) without training, so a test
    sees its grow before the epoch ends however slowly the joiner starts. One barrier per
    turn keeps the ranks' commits in step: they must all switch at the same commit."""
    while args.hold_below_world and state.step >= args.hold_from_step and elastic.size() < args.hold_below_world:
        dist.barrier()
        time.sleep(0.05)
        state.commit()  # raises HostsUpdatedInterrupt at the switch: train is re-entered


def setup_barrier():
    dist.barrier()
    append("barrier.jsonl", {"pid": os.getpid(), "round": elastic.round(), "where": args.setup_barrier})


@elastic.run
def train(state):
    if args.setup_barrier == "inside":  # every worker of every ring enters here: it always has a partner
        setup_barrier()
    rank, world = elastic.rank(), elastic.size()
    append("pids.jsonl", {"pid": os.getpid(), "rank": rank, "round": elastic.round(), "world": world})
    if args.record_slots:
        append("slots.jsonl", {"pid": os.getpid(), "rank": rank, "round": elastic.round(),
                               "local_rank": elastic.local_rank(), "env_local_rank": int(os.environ["LOCAL_RANK"]),
                               "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"])})
    # No initial broadcast: state.sync() made every copy equal, and a worker that went
    # on from another commit must show up as a difference, not be papered over.
    ddp = DDP(state.model, init_sync=False)
    if args.epochs:
        for state.epoch in range(state.epoch, args.epochs):
            if state.sampler.processed_count == 0:
                state.sampler.set_epoch(state.epoch)
            state.sampler.set_rank(rank, world)
            if args.global_batch_size:
                batches = list(state.sampler.batches(global_batch_size=args.global_batch_size,
                                                     micro_batch_size=args.micro_batch_size))
            else:
                batches = list(state.sampler.batches(4))
            for batch_idx, rows in enumerate(batches):
                if told_to_stop() or (args.max_steps is not None and state.step >= args.max_steps):
                    return
                hold_until_the_ring_grows()
                running = state.step + 1
                maybe_die("before-step", running)
                if args.global_batch_size:
                    rows = global_batch_step(ddp, rows)
                    state.sampler.record_batch(batch_idx)
                    batch = None
                else:
                    # Every rank logs the whole global batch: a rank killed after the step's
                    # all-reduce but before its own log line still had its share trained on
                    # and committed by the others, and the tests must see that share.
                    shares = [None] * world
                    dist.all_gather_object(shares, rows)
                    one_step(ddp, torch.tensor(rows))
                    state.sampler.record_batch(batch_idx, 4)
                    batch = [i for share in shares for i in share]
                state.step += 1
                record_step(rows, batch)
                time.sleep(args.step_delay)
                maybe_die("before-commit", running)
                maybe_die("after-peer-commit", running)
                if state.step % args.commit_every == 0:
                    commit_marked(running)
                maybe_die("after-commit", running)
            state.sampler.set_epoch(state.epoch + 1)
        return
    while state.step < args.steps and not told_to_stop():
        hold_until_the_ring_grows()
        step_started = time.monotonic()
        start = state.step * args.global_batch
        rows = torch.arange(start, start + args.global_batch)[rank::world]
        if args.fail_step is not None and state.step == args.fail_step and rank == args.fail_rank:
            raise ValueError(f"bad batch at step {state.step}")
        if state.step == args.accelerator_error_step and rank == args.accelerator_error_rank:
            marker = os.path.join(args.out, f"accelerator-error-{state.step}")
            if not os.path.exists(marker):
                with open(marker, "w") as f:
                    f.write(str(os.getpid()))
                raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
        maybe_stall_the_device(state.step)
        if state.step == args.oom_step:
            with open(os.path.join(args.out, f"oom-{os.getpid()}"), "w") as f:
                f.write(str(time.time()))
            raise torch.OutOfMemoryError(f"out of memory at step {state.step}: tried to allocate 64.00 GiB")
        if state.step == args.exit0_step and rank == args.exit0_rank:
            marker = os.path.join(args.out, f"exit0-{state.step}")
            if not os.path.exists(marker):
                with open(marker, "w") as f:
                    f.write(str(os.getpid()))
                os._exit(0)  # neither a return of the training function nor an error
        one_step(ddp, rows)
        maybe_die("after-allreduce", state.step + 1)  # trained by the ring, recorded by nobody yet
        state.step += 1
        record_step(None)
        time.sleep(args.step_delay + args.extra_step_delay)
        if args.slow_factor > 1:
            time.sleep((args.slow_factor - 1) * (time.monotonic() - step_started))
        if state.step % args.commit_every == 0:
            state.commit()
            if args.break_ring_every and state.step % args.break_ring_every == 0 and rank == world - 1:
                lifecycle.ring().abort()  # the next all-reduce fails on every rank


if args.setup_barrier == "before":
    setup_barrier()

train(state)
torch.save({k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
           os.path.join(args.out, f"final-{os.getpid()}.pt"))
