"""Durable checkpoints of a sharded state, in ``torch.distributed.checkpoint`` (DCP) format.

    <dir>/step-000000040/.metadata, __<rank>_0.distcp   DCP: every worker's own shards
    <dir>/step-000000040/state.pt                        the plain values (step, sampler ...)
    <dir>/step-000000040/manifest.json                   written last: every file's sha256

Every worker writes its own shards with ``dcp.async_save`` on a process group of its
own (so the writes' collectives never interleave with the training's), from a copy
taken at the commit; the step trains on meanwhile. Rank 0 finishes the write (DCP's
metadata comes after every rank's data), then adds the values and the manifest and
publishes the directory with one rename: a checkpoint exists only once complete, and
``elastic-run checkpoints DIR`` lists and verifies it like any other. Any world size
loads it, and so does a plain FSDP2 script:

    model = build(); fully_shard(...); opt = make_optimizer(model)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id="<dir>/step-000000040")
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

from elastic.checkpoint import CheckpointPolicy
from elastic.checkpoint import manifest as mf
from elastic.checkpoint.restore import list_checkpoints

log = logging.getLogger(__name__)

FORMAT = "dcp-sharded"  # the manifest's meta["format"]


def _dcp():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    return dcp, get_state_dict, set_state_dict


class ShardedCheckpoints:
    """This worker's side of the job's durable checkpoints (every rank has one)."""

    def __init__(self, policy: CheckpointPolicy):
        self.policy = policy
        self._group = None
        self._group_key = None
        self._pending = None  # (future, publish thread or None)
        self._last_submit = time.monotonic()
        self.last_error: Optional[BaseException] = None

    def due(self, commits: int) -> bool:
        """Every rank decides alike (same commit counts; a time rule asks rank 0)."""
        p = self.policy
        due = p.every_commits is not None and commits > 0 and commits % p.every_commits == 0
        if p.every_seconds is not None and not due:
            flag = torch.tensor([time.monotonic() - self._last_submit >= p.every_seconds], dtype=torch.int64)
            dist.broadcast(flag, src=0)
            due = bool(flag.item())
        return due

    def group(self, round_number: int):
        """The writes' own process group for this round (made collectively, in ``sync``)."""
        key = (round_number, dist.get_world_size())
        if self._group_key != key:
            self._group = dist.new_group(backend="gloo")
            self._group_key = key
        return self._group

    def submit(self, model, optimizer, values: dict, *, step: int, round_number: int, world: int) -> None:
        """Write the live state (a commit) in the background; waits for the previous write first."""
        dcp, get_state_dict, _ = _dcp()
        self.flush()
        self._last_submit = time.monotonic()
        msd, osd = get_state_dict(model, optimizer)
        # A copy taken now: the step after the commit changes the live tensors.
        state = {"model": _cloned(msd), "optim": _cloned(osd)}
        temporary = os.path.join(self.policy.directory, f"{mf.TMP_PREFIX}{mf.step_dirname(step)}-r{round_number}")
        rank = dist.get_rank()
        if rank == 0:
            shutil.rmtree(temporary, ignore_errors=True)
        dist.barrier(group=self.group(round_number))
        future = dcp.async_save(state, checkpoint_id=temporary, process_group=self.group(round_number))
        publisher = None
        if rank == 0:
            publisher = threading.Thread(target=self._publish, args=(future, temporary, values, step, round_number,
                                                                     world), name="sharded-checkpoint", daemon=True)
            publisher.start()
        self._pending = (future, publisher)

    def abandon(self) -> None:
        """Forget the write in flight: its ring broke (rank 0 still publishes it if it completes)."""
        self._pending = None

    def flush(self) -> None:
        """Wait for the write in flight, if any (every rank: the next one's collectives follow it)."""
        if self._pending is None:
            return
        future, publisher = self._pending
        self._pending = None
        try:
            future.result()
        except Exception as exc:  # the ring broke under it, or the disk failed: not published
            self.last_error = exc
            log.error("durable checkpoint failed: %s", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        if publisher is not None:
            publisher.join()

    def _publish(self, future, temporary: str, values: dict, step: int, round_number: int, world: int) -> None:
        started = time.monotonic()
        try:
            future.result()
            torch.save(values, os.path.join(temporary, mf.STATE_NAME))
            files = {}
            for name in sorted(os.listdir(temporary)):
                size, sha = mf.file_digest(os.path.join(temporary, name))
                files[name] = {"size": size, "sha256": sha}
            mf.write_manifest(temporary, mf.build_manifest(step=step, files=files, created=time.time(),
                                                           epoch=values.get("values", {}).get("epoch"),
                                                           round=round_number, world_size=world,
                                                           meta={"format": FORMAT}))
            final = self._free_name(step)
            os.rename(temporary, final)
            mf.fsync_dir(self.policy.directory)
            self._prune()
            log.info("durable checkpoint step %d (DCP, world %d) in %s after %.3fs", step, world, final,
                     time.monotonic() - started)
        except Exception as exc:
            self.last_error = exc
            log.error("durable checkpoint of step %d not published: %s", step, exc)

    def _free_name(self, step: int) -> str:
        version = 0
        while os.path.exists(os.path.join(self.policy.directory, mf.checkpoint_dirname(step, version))):
            version += 1
        return os.path.join(self.policy.directory, mf.checkpoint_dirname(step, version))

    def _prune(self) -> None:
        published = [info for info in list_checkpoints(self.policy.directory) if info.valid]
        for info in published[self.policy.keep:]:
            shutil.rmtree(info.path, ignore_errors=True)


def newest_valid(directory: str) -> Optional[tuple[str, dict]]:
    """(path, manifest) of the newest complete sharded checkpoint whose checksums hold."""
    for info in list_checkpoints(directory):
        if info.valid and (info.manifest.get("meta") or {}).get("format") == FORMAT:
            return info.path, info.manifest
        log.warning("skipping checkpoint %s: %s", info.path, info.reason or "not a sharded (DCP) checkpoint")
    return None


def load_into(path: str, model, optimizer, group) -> dict:
    """Load the checkpoint at ``path`` into the (sharded) model and optimizer, at any world size;
    returns its plain values."""
    dcp, get_state_dict, set_state_dict = _dcp()
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path, process_group=group)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return torch.load(os.path.join(path, mf.STATE_NAME), map_location="cpu", weights_only=True)


def _cloned(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {key: _cloned(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_cloned(value) for value in tree]
    return tree
