"""Durable checkpoints of a sharded state, in ``torch.distributed.checkpoint`` (DCP) format.

    <dir>/step-000000040/.metadata, __<rank>_0.distcp   DCP: every worker's own shards
    <dir>/step-000000040/state.pt                        the plain values (step, sampler ...)
    <dir>/step-000000040/manifest.json                   written last: every file's sha256

Every worker writes its own shards with ``dcp.async_save`` on a process group of its
own (so the writes' collectives never interleave with the training's), from a copy
taken at the commit; the step trains on meanwhile. A state on CUDA is copied into
pinned host memory that is kept for the ring's next writes (``_pinned_stager``): the
copy runs at the device's bandwidth and allocates nothing after the ring's first
write, at the price of holding one pinned copy of the worker's shards while the ring
lasts (a pageable copy was allocated for each write and lived until it was written).
Rank 0 finishes the write (DCP's metadata comes after every rank's data), then adds
the values and the manifest and publishes the directory with one rename: a checkpoint
exists only once complete, and ``elastic-run checkpoints DIR`` lists and verifies it
like any other. Any world size loads it, and so does a plain FSDP2 script:

    model = build(); fully_shard(...); opt = make_optimizer(model)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id="<dir>/step-000000040")
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)

What protects the directory is the plain writer's (checkpoint/durable.py): the temporary
is named after rank 0's process (``.tmp-step-<n>-r<round>@<host>:<pid>``) and removed
when a write fails, and the temporaries of writers that are gone are removed at the
first write; ``state.pt``, the manifest and the temporary itself are fsynced before
the rename; the publish check and the directory's owner are asked right before and right after
it; a prune goes by name (checkpoint/retention.py), never re-reading a checkpoint, and
never deletes or supersedes an earlier run's step above the one this run resumed from.
Checkpoints that exist but cannot be read at a resume are retried, then fail the job
(checkpoint/restore.py), unless the policy skips them.
A resume's choice of checkpoint and its verification: ``resume_check.py``.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import threading
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from elastic.checkpoint import CheckpointPolicy, PublishRefusal
from elastic.checkpoint import host_pinning
from elastic.checkpoint import manifest as mf
from elastic.checkpoint import owner as ownership
from elastic.checkpoint.retention import checkpoint_names, names_to_prune, remove_stale_tmps, superseded_step


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
        self._lead = 0  # the rank that names, finishes and publishes a write (the group's lowest)
        self._decide = None  # the group the time rule is agreed on (None: the ring's)
        self._pending = None  # (future, publish thread or None)
        self._last_submit = time.monotonic()
        self._swept = False  # the temporaries of writers that are gone removed (rank 0, once)
        self._published: set[str] = set()  # names this process published
        # The step this run resumed from (-1: the initial state); None: it took over a
        # running job. The directory's steps above it are an earlier run's (retention.py).
        self.resumed_from: Optional[int] = None
        self.last_error: Optional[BaseException] = None
        self._stager = None  # DCP's stager into pinned memory for a state on CUDA (_stager_for)

    def due(self, commits: int) -> bool:
        """Every rank decides alike (same commit counts; a time rule asks rank 0)."""
        p = self.policy
        due = p.every_commits is not None and commits > 0 and commits % p.every_commits == 0
        if p.every_seconds is not None and not due:
            flag = torch.tensor([time.monotonic() - self._last_submit >= p.every_seconds], dtype=torch.int64)
            dist.broadcast(flag, src=self._lead, group=self._decide)
            due = bool(flag.item())
        return due

    def group(self, round_number: int, ranks: Optional[Sequence[int]] = None):
        """The writes' own process group for this round (made collectively, in ``sync``): every
        rank of the ring, or ``ranks`` only (a hybrid mesh's training ranks: its spares hold no
        live model). Every rank of the ring makes it; its lowest rank leads the writes."""
        key = (round_number, dist.get_world_size())
        if self._group_key != key:
            members = sorted(ranks) if ranks is not None else None
            self._group = dist.new_group(ranks=members, backend="gloo")
            # The time rule's broadcast (due) never shares the writes' group: a write's
            # collectives run on DCP's thread while the next commit asks.
            self._decide = dist.new_group(ranks=members, backend="gloo") if members is not None else None
            self._lead = members[0] if members else 0
            self._group_key = key
        return self._group

    def submit(self, model, optimizer, values: dict, *, step: int, round_number: int, world: int,
               still_current: Optional[Callable[[], bool]] = None) -> None:
        """Write the live state (a commit) in the background; waits for the previous write first.
        ``still_current``: the publish check, asked by rank 0 right before and after publishing."""
        dcp, get_state_dict, _ = _dcp()
        self.flush()
        self._last_submit = time.monotonic()
        msd, osd = get_state_dict(model, optimizer)
        # A copy taken now: the step after the commit changes the live tensors. Host copies
        # only: dcp.async_save stages device tensors to host memory before it returns (its
        # default stager is synchronous, and so is ours, _pinned_stager), so a clone on the
        # GPU would cost +1x the shards' memory there for nothing, an OOM for the
        # memory-tight jobs FSDP is for (gpu review G11).
        state = {"model": _cloned(msd), "optim": _cloned(osd)}
        rank, group, lead = dist.get_rank(), self.group(round_number), self._lead
        if rank == lead:
            self._sweep()
        # Every rank writes into the temporary that the lead names after its own process, so
        # that a later writer can tell whether the one that made it is gone.
        writer = _broadcast_text(f"{socket.gethostname()}:{os.getpid()}" if rank == lead else "", group, lead)
        temporary = os.path.join(self.policy.directory,
                                 f"{mf.TMP_PREFIX}{mf.step_dirname(step)}-r{round_number}@{writer}")
        stager = self._stager_for(state)
        if stager is None:
            future = dcp.async_save(state, checkpoint_id=temporary, process_group=group)
        else:
            try:
                future = dcp.async_save(state, checkpoint_id=temporary, process_group=group, async_stager=stager)
            except Exception as exc:  # noqa: BLE001 - staging (before any write) failed: stage as before
                self._refuse_pinned_staging(exc)
                future = dcp.async_save(state, checkpoint_id=temporary, process_group=group)
        publisher = None
        if rank == lead:
            publisher = threading.Thread(target=self._publish, args=(future, temporary, values, step, round_number,
                                                                     world, still_current),
                                         name="sharded-checkpoint", daemon=True)
            publisher.start()
        self._pending = (future, publisher)

    def abandon(self) -> None:
        """Forget the write in flight: its ring broke (rank 0 still publishes it if it completes)."""
        self._pending = None
        # The next write may not stage into the buffers this one may still be writing from,
        # and the new ring's model has new storages anyway: the old ones' copies go.
        self._drop_stager()

    def _stager_for(self, state) -> Optional[object]:
        """DCP's stager that copies ``state`` into pinned host memory, kept across this
        ring's writes (its copies are reused: one allocation per ring, not per write), or
        None to stage as ``async_save`` does by default (freshly allocated pageable memory,
        which is all a host state needs)."""
        if _pinned_staging_refused is not None or host_pinning.refused() is not None or not _on_cuda(state):
            return None
        if self._stager is None:
            self._stager = _pinned_stager()
        return self._stager

    def _drop_stager(self) -> None:
        if self._stager is not None:
            self._stager.close()  # its copies go once no write uses them
            self._stager = None

    def _refuse_pinned_staging(self, exc: BaseException) -> None:
        """Staging into pinned memory failed: from now on this process stages as before.
        DCP pins with cudaHostRegister, whose refusal stays CUDA's "last error" on this
        thread and would fail an unrelated kernel launch later (gpu review 3, N3): cleared."""
        global _pinned_staging_refused
        if host_pinning.clear_last_error_with_library() is None:
            host_pinning.clear_last_error_with_kernel()  # raises if the error is sticky: a broken device
        _pinned_staging_refused = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:160]}"
        log.warning("durable checkpoints stage into pageable memory from now on: staging into pinned memory "
                    "failed (%s)", _pinned_staging_refused)
        self._drop_stager()

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

    def _sweep(self) -> None:
        """Once per process (rank 0): create the directory, remove the temporaries of writers that are gone."""
        if self._swept:
            return
        self._swept = True
        try:
            os.makedirs(self.policy.directory, mode=mf.DIR_MODE, exist_ok=True)
            remove_stale_tmps(self.policy.directory)
        except OSError as exc:
            log.warning("cannot clean up the temporaries in %s: %s", self.policy.directory, exc)

    def _publish(self, future, temporary: str, values: dict, step: int, round_number: int, world: int,
                 still_current: Optional[Callable[[], bool]] = None) -> None:
        started = time.monotonic()
        directory = self.policy.directory
        try:
            future.result()
            with mf.open_private(os.path.join(temporary, mf.STATE_NAME)) as f:
                torch.save(values, f)
                f.flush()
                os.fsync(f.fileno())
            files = {}
            for name in sorted(os.listdir(temporary)):
                path = os.path.join(temporary, name)
                os.chmod(path, mf.FILE_MODE)  # DCP's files follow the umask
                size, sha = mf.file_digest(path)
                files[name] = {"size": size, "sha256": sha}
            mf.write_manifest(temporary, mf.build_manifest(step=step, files=files, created=time.time(),
                                                           epoch=values.get("values", {}).get("epoch"),
                                                           round=round_number, world_size=world,
                                                           meta={"format": FORMAT}))
            os.chmod(temporary, mf.DIR_MODE)
            mf.fsync_dir(temporary)  # its entries (DCP's files, state.pt, the manifest) before the rename
            refusal = self._refusal(still_current, round_number) or self._superseding(step)
            if refusal is not None:
                raise PublishRefusal(refusal)
            final = self._free_name(step)
            os.rename(temporary, final)
            refusal = self._refusal(still_current, round_number)  # the rename may have stalled meanwhile
            if refusal is not None:
                os.rename(final, temporary)  # loaders ignore a .tmp- name: taken back at once
                raise PublishRefusal(f"taken back right after publishing: {refusal}")
            self._published.add(os.path.basename(final))
            mf.fsync_dir(directory)
            self._prune(final)
            log.info("durable checkpoint step %d (DCP, world %d) in %s after %.3fs", step, world, final,
                     time.monotonic() - started)
        except Exception as exc:
            self.last_error = exc
            shutil.rmtree(temporary, ignore_errors=True)  # its partial shards would fill the disk
            log.error("durable checkpoint of step %d not published: %s", step, exc)

    def _refusal(self, still_current: Optional[Callable[[], bool]], round_number: int) -> Optional[str]:
        """Why the write must not be (or stay) published: the directory is another job's
        now, or its round is over. None to publish."""
        why = ownership.refusal(self.policy.directory, self.policy.job_id)
        if why is not None or still_current is None:
            return why
        try:
            return None if still_current() else f"its round {round_number} is over"
        except PublishRefusal as exc:
            return str(exc)
        except Exception as exc:  # noqa: BLE001 - a publish check that cannot be made refuses
            return f"cannot tell whether its round {round_number} is current ({exc})"

    def _superseding(self, step: int) -> Optional[str]:
        theirs = superseded_step(checkpoint_names(self.policy.directory), step, resumed_from=self.resumed_from,
                                 published=self._published)
        if theirs is None:
            return None
        return f"{theirs} is newer than step {self.resumed_from} this run resumed from: not superseding it"

    def _free_name(self, step: int) -> str:
        version = 0
        while os.path.exists(os.path.join(self.policy.directory, mf.checkpoint_dirname(step, version))):
            version += 1
        return os.path.join(self.policy.directory, mf.checkpoint_dirname(step, version))

    def _prune(self, own: str) -> None:
        """By name: never reads a checkpoint back (retention.names_to_prune)."""
        try:
            names = checkpoint_names(self.policy.directory)
        except OSError as exc:
            log.warning("cannot list %s to prune old checkpoints: %s", self.policy.directory, exc)
            return
        own_key = mf.parse_checkpoint_dirname(os.path.basename(own))
        for name in names_to_prune(names, own_key, self.policy.keep, resumed_from=self.resumed_from,
                                   published=self._published):
            shutil.rmtree(os.path.join(self.policy.directory, name), ignore_errors=True)


def load_into(path: str, model, optimizer, group) -> dict:
    """Load the checkpoint at ``path`` into the (sharded) model and optimizer, at any world size;
    returns its plain values."""
    dcp, get_state_dict, set_state_dict = _dcp()
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path, process_group=group)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return torch.load(os.path.join(path, mf.STATE_NAME), map_location="cpu", weights_only=True)


def _broadcast_text(text: str, group, src: int = 0) -> str:
    """Rank ``src``'s ``text`` on every rank of ``group``: plain bytes, never a pickle."""
    size = torch.tensor([len(text.encode())], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    data = torch.zeros(int(size.item()), dtype=torch.uint8)
    if dist.get_rank() == src:
        data = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)
    dist.broadcast(data, src=src, group=group)
    return bytes(data.tolist()).decode()


_pinned_staging_refused: Optional[str] = None  # why this process stages into pageable memory, once it does


def _pinned_stager():
    """A synchronous DCP stager into pinned host memory that keeps its copies for the next
    write, or None where this torch has none. Synchronous, as ``async_save``'s default:
    the copy is complete when ``submit`` returns, so the next step may change the live
    tensors at once. Staging in the background as well would need the optimizer's step
    to wait for it, and blocking copies need no device-wide synchronisation (which
    would also wait for an NCCL kernel blocked on a peer)."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        return DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                            use_async_staging=False, use_non_blocking_copy=False))
    except Exception as exc:  # noqa: BLE001 - an older torch: its default staging then
        log.debug("no pinned staging for durable checkpoints: %s", exc)
        return None


def _on_cuda(tree) -> bool:
    """Whether ``tree`` holds a CUDA tensor."""
    if isinstance(tree, torch.Tensor):
        return tree.device.type == "cuda"
    if isinstance(tree, dict):
        return any(_on_cuda(value) for value in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(_on_cuda(value) for value in tree)
    return False


def _cloned(tree):
    """``tree`` with its host tensors cloned; device tensors are left to DCP's staging."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone() if tree.device.type == "cpu" else tree.detach()
    if isinstance(tree, dict):
        return {key: _cloned(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_cloned(value) for value in tree]
    return tree
