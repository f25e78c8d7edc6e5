"""What benchmarks/sharded.py and benchmarks/sharded_torchrun.py share: the model, the
steps per size, a worker's memory as the kernel counts it, and the figures (pure).

Model: 4 square ``Linear`` layers (weight + bias), float32, Adam: the state is the
parameters and Adam's ``exp_avg`` and ``exp_avg_sq`` (3 x 4 bytes per parameter).

Memory bound of the issue, per worker of the new ring after a re-shard: its live shard
(parameters + both Adam states of its new rows) + its snapshot (the own slot of a
commit: the same bytes) + the replicas it keeps (``--shard-replicas`` other ranks'
shards) + one transfer chunk. ShardedState posts every piece of the re-shard plan at
once, straight into the live tensors (``elastic/sharded/pieces.py``), so
a transfer needs no staging buffer; the chunk counted is the largest single piece
(one tensor's element range from one holder, ``reshard_plan.plan_reshard``) this rank
receives.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Iterable, Optional, Sequence

LAYERS = 4
STATES = 3  # the parameter, exp_avg, exp_avg_sq
ITEMSIZE = 4  # float32
ADAM_STATES = ("exp_avg", "exp_avg_sq")


def width_for(size_mb: float) -> int:
    """Width of the 4 square layers whose parameters + Adam's two states make ``size_mb``."""
    return max(8, int((size_mb * 1e6 / ITEMSIZE / STATES / LAYERS) ** 0.5))


def build_model(width: int):
    """The unsharded model, the same on every worker and in both launchers (seed 0)."""
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(LAYERS)])


def newest_checkpoint(root: Path) -> Optional[Path]:
    """The newest checkpoint directory DCP finished (its ``.metadata`` is written last)."""
    done = [p for p in root.glob("*") if p.name.isdigit() and (p / ".metadata").exists()] if root.exists() else []
    return max(done, key=lambda p: int(p.name), default=None)


def fsdp_from_newest(width: int, mesh, newest: Optional[Path]):
    """torchrun + DCP's worker start: ``build_model`` sharded by FSDP2 on ``mesh`` (per layer,
    then the root) and Adam; with a checkpoint, built on the meta device and loaded from it.
    Returns (model, optimizer, step)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta" if newest is not None else "cpu"):
        model = build_model(width)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if newest is not None:
        model.to_empty(device="cpu")
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    if newest is None:
        return model, opt, 0
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(newest))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, opt, int(newest.name)


def steps_for(size_mb: float, steps: int, kill_step: int, big_steps: int, big_kill_step: int,
              big_from_mb: float) -> tuple[int, int]:
    """(steps, kill step) of one size: big sizes run fewer steps (each takes seconds here)."""
    chosen = (big_steps, big_kill_step) if size_mb >= big_from_mb else (steps, kill_step)
    if not 2 <= chosen[1] < chosen[0]:
        raise ValueError(f"the kill step must leave steps before and after it: {chosen} at {size_mb:g} MB")
    return chosen


def timeout_for(size_mb: float, steps: int) -> float:
    """Seconds one launcher may run at one size (a step of 1 GB takes seconds on 2 loaded cores)."""
    return 900 + steps * (2 + size_mb / 20)


# -- a worker's memory, from /proc (Linux) ---------------------------------------------
def proc_memory_mb() -> dict[str, float]:
    """This process's resident memory now (rss) and its peak since start or the last reset (hwm)."""
    with open("/proc/self/status") as f:
        text = f.read()
    return {name: int(re.search(rf"{field}:\s+(\d+) kB", text).group(1)) / 1024
            for name, field in (("rss", "VmRSS"), ("hwm", "VmHWM"))}


def reset_peak_memory() -> bool:
    """Make the kernel's peak (VmHWM) the current RSS, so a later peak is this phase's own."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# -- the memory bound (pure) -------------------------------------------------------------
def layout(width: int):
    """The sharded tensors of a commit (``elastic.sharded.modules.sharded_tensors``' keys)."""
    from elastic.sharded.reshard_plan import TensorLayout

    tensors = []
    for layer in range(LAYERS):
        for name, shape in (("weight", (width, width)), ("bias", (width,))):
            tensors.append(TensorLayout(f"model.{layer}.{name}", shape, "float32"))
            tensors += [TensorLayout(f"optim.{layer}.{name}.{s}", shape, "float32") for s in ADAM_STATES]
    return tuple(tensors)


def shard_bytes(tensors: Sequence, world: int, rank: int) -> int:
    return sum(t.shard_elements(world, rank) * ITEMSIZE for t in tensors)


def reshard_holders(old_world: int, lost: Iterable[int], replicas: int) -> dict[int, list[int]]:
    """Old shard -> the new ranks holding it whole after ``lost`` old ranks died on one host:
    its owner and the ranks keeping its replica (``placement.replica_holders``), the
    survivors numbered in their old order."""
    from elastic.sharded.placement import replica_holders

    lost = set(lost)
    new_rank = {old: new for new, old in enumerate(r for r in range(old_world) if r not in lost)}
    keepers = replica_holders(["host"] * old_world, replicas)
    return {shard: sorted(new_rank[r] for r in (shard, *keepers[shard]) if r in new_rank)
            for shard in range(old_world)}


def memory_bound(width: int, old_world: int, lost: Iterable[int], replicas: int) -> list[dict]:
    """Per rank of the new ring, the issue's bound (bytes) and its parts."""
    from elastic.sharded.placement import replica_holders, replicas_of
    from elastic.sharded.reshard_plan import plan_reshard

    tensors, lost = layout(width), list(lost)
    world = old_world - len(lost)
    pieces = plan_reshard(tensors, old_world, reshard_holders(old_world, lost, replicas), world)
    keepers = replica_holders(["host"] * world, replicas)
    bounds = []
    for rank in range(world):
        live = shard_bytes(tensors, world, rank)
        kept = sum(shard_bytes(tensors, world, owner) for owner in replicas_of(keepers, rank))
        chunk = max((p.length * ITEMSIZE for p in pieces if p.receiver == rank and p.holder != rank), default=0)
        bounds.append({"rank": rank, "live": live, "snapshot": live, "replicas": kept, "chunk": chunk,
                       "bound": 2 * live + kept + chunk})
    return bounds


# -- figures from the workers' records (pure) ------------------------------------------------
def loop_time(record: dict) -> float:
    """One iteration of the training loop: the step, the copy_ floor and the snapshot (commit or save)."""
    return record["step_s"] + record["copy_s"] + record["snapshot_s"]


def recovery_figures(before: Sequence[dict], after: Sequence[dict], killed_at: float) -> dict:
    """Kill -> the first step completed after the kill by the new ring, and that less one
    median loop iteration before the kill (the re-run step is not a stall)."""
    step_median = statistics.median(loop_time(r) for r in before)
    first = min((r for r in after if r["t"] > killed_at), key=lambda r: r["t"])
    next_step = first["t"] - killed_at
    return {"kill_to_next_step_s": round(next_step, 3), "stall_beyond_rerun_s": round(next_step - step_median, 3),
            "step_median_s": round(step_median, 4), "resumed_at_step": first["step"],
            "train_median_s": round(statistics.median(r["step_s"] for r in before), 4),
            "snapshot_median_s": round(statistics.median(r["snapshot_s"] for r in before), 4),
            "copy_median_s": round(statistics.median(r["copy_s"] for r in before), 4)}


def memory_verdict(peaks_mb: dict[int, float], bounds: Sequence[dict]) -> dict:
    """The worst rank's measured peak (MB) against its bound: the goal holds on every rank or not."""
    worst = max(peaks_mb, key=lambda r: peaks_mb[r] - bounds[r]["bound"] / 1e6)
    return {"rank": worst, "peak_mb": round(peaks_mb[worst], 1),
            "bound_mb": round(bounds[worst]["bound"] / 1e6, 1),
            "bound_parts_mb": {k: round(bounds[worst][k] / 1e6, 2) for k in ("live", "snapshot", "replicas", "chunk")},
            "met": all(peaks_mb[r] <= bounds[r]["bound"] / 1e6 for r in peaks_mb)}


def fmt_ms(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"
