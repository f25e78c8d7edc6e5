"""Durable checkpoints written in the background, atomically, keeping the last K.

The training loop only pays for one copy of the state into a staging snapshot that the
writer owns; a background thread then serializes, checksums, fsyncs and renames:

    .tmp-step-000000123-<hex>@<host>:<pid>/state.pt       torch.save, sha256 computed while writing
    .tmp-step-000000123-<hex>@<host>:<pid>/manifest.json  written last
    fsync files, fsync the tmp dir, rename to step-000000123/, fsync the parent

so a crash at any moment leaves either the complete new checkpoint or none of it.
Older checkpoints are pruned only after the new one is durable. I/O failures (read-only
file system, ENOSPC, permissions) never reach the training loop: they are logged as one
line, kept in ``last_error``, and the partial tmp dir is removed.

Two writers may share a directory for a while (an old rank 0 still writing while a new
one starts), so nothing a writer does may destroy the other's work:

* a tmp dir names its writer (host and pid); a new writer removes it only when that
  process is gone, or, for a writer on another host (or of unknown name), when the
  dir has not changed for ``STALE_TMP_SECONDS``;
* publishing is one rename to a name that does not exist yet: a rewrite of a step
  becomes ``step-<n>.<version>``, which loaders prefer; nothing is renamed aside;
* a prune deletes only checkpoints older than the one its writer just published.

A writer that resumed from an older step than the directory's newest (the newer ones
were corrupt, or unreadable and the user allowed a fresh start: ``resumed_from``) must
not bury the newer ones either: it never publishes a rewrite of a step above
``resumed_from`` that it did not write itself, and never prunes one. And a writer of
one job never publishes into a directory another job claimed (owner.py).

A write may carry a publish check (``still_current``), asked right before publishing: a
rank 0 whose round is over must not publish what it wrote for that round. The check
returns True to publish; False or any exception refuses, and a ``PublishRefusal`` says
why in the writer's one line about it. The check (and the directory's owner) is asked
again right after the rename: a rename that stalled (a frozen NFS mount) while the job
moved on is taken back at once, before anything is pruned for it.

Files are created 0600 and directories 0700 (manifest.py's ``FILE_MODE``/``DIR_MODE``).

Each write's outcome can be reported (``report``, called on the writer's thread as
``report(name, **fields)``): ``checkpoint_written`` (step, bytes, seconds, path) or
``checkpoint_failed`` (step, error); elastic passes its event log, so the agent's
metrics show the last durable checkpoint without reading the directory.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import secrets
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import manifest as mf
from . import owner as ownership
from .retention import checkpoint_names as _checkpoint_names
from .retention import names_to_prune, remove_stale_tmps, superseded_step
from .snapshot import Snapshot

__all__ = ["CheckpointPolicy", "DurableWriter", "PublishRefusal", "check_local_directory"]

logger = logging.getLogger(__name__)

# A test's hook, called with (step, tmp dir) before each write puts its data down, so an
# end-to-end test can hold a final checkpoint "still being written" when the job ends
# (tests/fakes/fault_plan/). None in production: nothing here reads the environment.
before_write: Callable[[int, str], None] | None = None


def check_local_directory(directory: str) -> None:
    """Only local paths are supported: one-line ValueError for anything else."""
    if not isinstance(directory, str) or not directory:
        raise ValueError(f"checkpoint directory must be a non-empty path, got {directory!r}")
    if "://" in directory:
        # Object stores have no atomic rename; supporting them means a different commit
        # protocol (manifest as the commit marker), which nothing needs yet.
        raise ValueError(f"checkpoint directory {directory!r}: only local paths are supported, not URLs")


@dataclass(frozen=True)
class CheckpointPolicy:
    """Where and how often durable checkpoints are written, and how many are kept."""

    directory: str
    every_commits: int | None = None  # write every N commits
    every_seconds: float | None = None  # and/or every T seconds
    keep: int = 3
    # At a resume: skip checkpoints that cannot be read (after the retries) instead of
    # failing, i.e. start from an older one or the initial state (restore.py).
    skip_unreadable: bool = False
    # The job whose directory it is (owner.py); None: no claim is checked (a writer
    # used without elastic-run).
    job_id: str | None = None

    def __post_init__(self) -> None:
        check_local_directory(self.directory)
        if self.every_commits is not None and (
            not isinstance(self.every_commits, int) or isinstance(self.every_commits, bool) or self.every_commits < 1
        ):
            raise ValueError(f"every_commits must be a positive integer or None, got {self.every_commits!r}")
        if self.every_seconds is not None and (
            isinstance(self.every_seconds, bool)
            or not isinstance(self.every_seconds, (int, float))
            or not self.every_seconds > 0
        ):
            raise ValueError(f"every_seconds must be a positive number or None, got {self.every_seconds!r}")
        if not isinstance(self.keep, int) or isinstance(self.keep, bool) or self.keep < 1:
            raise ValueError(f"keep must be an integer >= 1, got {self.keep!r}")


class PublishRefusal(Exception):
    """Raised by a write's publish check to refuse it; str() is the reason, logged as is."""


class _HashingWriter:
    """Unbuffered file writer that computes sha256 and size while torch.save writes.

    Hashing on the way out avoids reading the file back. The first OSError is kept
    because torch.save reports a failed write as a RuntimeError without the errno.
    """

    def __init__(self, fileobj) -> None:
        self._f = fileobj  # opened with buffering=0: every write reaches the OS
        self.sha256 = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        try:
            done = 0
            while done < len(view):
                done += self._f.write(view[done:])
        except OSError as exc:
            self.error = self.error or exc
            raise
        self.sha256.update(view)
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        pass


@dataclass(frozen=True)
class _Job:
    step: int
    epoch: int | None
    round: int | None
    world_size: int | None
    meta: dict | None
    still_current: Callable[[], bool] | None


class DurableWriter:
    """Writes checkpoints of a tree per `policy` on a background thread (one at a time)."""

    def __init__(self, policy: CheckpointPolicy, *, clock: Callable[[], float] = time.monotonic,
                 report: Callable[..., None] | None = None, resumed_from: int | None = None) -> None:
        """``resumed_from``: the step the job's state was loaded from at its (re)start (-1:
        the initial state); the directory's steps above it are an earlier run's, to be
        kept. None: whatever is there may be superseded and pruned (a writer that took
        over a running job, whose older writers' steps are its own history)."""
        self.policy = policy
        self._resumed_from = resumed_from
        self._published: set[str] = set()  # names this writer published
        self._clock = clock
        self._report = report
        self._staging = Snapshot()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._skip_logged = False
        self._last_submit = clock()
        self.last_error: str | None = None
        self.last_path: str | None = None  # the newest checkpoint this writer made durable
        self.last_write_seconds: float | None = None  # background time of the last write
        self.skipped = 0  # submits dropped because a write was still running
        self._prepare_directory()

    # -- policy -------------------------------------------------------------------------

    def due(self, commits: int) -> bool:
        """Is a write due after `commits` commits (per policy)? Cheap; changes nothing."""
        p = self.policy
        if p.every_commits is not None and commits > 0 and commits % p.every_commits == 0:
            return True
        if p.every_seconds is not None and self._clock() - self._last_submit >= p.every_seconds:
            return True
        return False

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- writing ------------------------------------------------------------------------

    def submit(
        self,
        tree: Any,
        *,
        step: int,
        epoch: int | None = None,
        round: int | None = None,
        world_size: int | None = None,
        meta: dict | None = None,
        still_current: Callable[[], bool] | None = None,
    ) -> bool:
        """Stage a copy of `tree` and write it in the background. False if skipped.

        The copy is the only stall the caller sees. A submit while the previous write is
        still running is dropped, not queued: a queue would hold stale states in memory.
        ``still_current`` is asked (on the writer's thread) once the data is written and
        before it is published; False, or an exception, refuses the write: its round is
        over and a newer rank 0 owns the directory.
        """
        if self._closed:
            raise ValueError("DurableWriter is closed")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        if self.busy:
            self.skipped += 1
            if not self._skip_logged:
                self._skip_logged = True
                logger.info("checkpoint of step %d skipped: the previous write to %s is still running "
                            "(further skips are not logged)", step, self.policy.directory)
            return False
        self._staging.capture(tree)
        self._last_submit = self._clock()
        job = _Job(step, epoch, round, world_size, dict(meta) if meta else None, still_current)
        self._thread = threading.Thread(target=self._write, args=(job,), name="checkpoint-writer", daemon=True)
        self._thread.start()
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the in-flight write; True if none is running any more."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return not self.busy

    def close(self) -> None:
        """Wait for the in-flight write and refuse further submits."""
        self.flush()
        self._closed = True

    def __enter__(self) -> "DurableWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- background ---------------------------------------------------------------------

    def _prepare_directory(self) -> None:
        """Create the directory and remove the tmp dirs of writers that are gone."""
        directory = self.policy.directory
        try:
            os.makedirs(directory, mode=mf.DIR_MODE, exist_ok=True)
            remove_stale_tmps(directory)
        except OSError as exc:
            self._fail(f"checkpoint directory {directory} is not usable: {_describe(exc)}")

    def _write(self, job: _Job) -> None:
        started = time.monotonic()
        directory = self.policy.directory
        final = os.path.join(directory, mf.step_dirname(job.step))
        owner = f"{socket.gethostname()}:{os.getpid()}"  # at write time: a fork has its own pid
        tmp = os.path.join(directory, f"{mf.TMP_PREFIX}{mf.step_dirname(job.step)}-{secrets.token_hex(4)}@{owner}")
        try:
            os.makedirs(directory, mode=mf.DIR_MODE, exist_ok=True)
            mf.make_private_dir(tmp)
            if before_write is not None:
                before_write(job.step, tmp)
            files = {mf.STATE_NAME: self._write_state(os.path.join(tmp, mf.STATE_NAME))}
            manifest = mf.build_manifest(
                step=job.step, files=files, created=time.time(), epoch=job.epoch,
                round=job.round, world_size=job.world_size, meta=job.meta,
            )
            mf.write_manifest(tmp, manifest)
            mf.fsync_dir(tmp)
            refusal = self._refusal(job) or self._superseding(job.step)
            if refusal is not None:
                shutil.rmtree(tmp, ignore_errors=True)
                self._refused(f"checkpoint of step {job.step} not published: {refusal}", job.step)
                return
            final = self._publish(tmp, job.step)
            refusal = self._refusal(job)  # the rename may have stalled while the job moved on
            if refusal is not None:
                self._retract(final, tmp)
                self._refused(f"checkpoint of step {job.step} taken back right after publishing: {refusal}",
                              job.step)
                return
            self._published.add(os.path.basename(final))
            mf.fsync_dir(directory)
        except Exception as exc:  # noqa: BLE001 - nothing may escape into training
            shutil.rmtree(tmp, ignore_errors=True)
            self._fail(f"checkpoint of step {job.step} to {final} failed: {_describe(exc)}", step=job.step)
            return
        self.last_error = None
        self.last_path = final
        self.last_write_seconds = time.monotonic() - started
        logger.debug("checkpoint of step %d written to %s in %.3f s", job.step, final, self.last_write_seconds)
        self._tell("checkpoint_written", step=job.step, bytes=files[mf.STATE_NAME]["size"],
                   seconds=round(self.last_write_seconds, 4), path=final)
        self._prune(own=final)

    def _write_state(self, path: str) -> dict[str, Any]:
        with mf.open_private(path, "wb", buffering=0) as f:
            out = _HashingWriter(f)
            try:
                torch.save(self._staging.tree(), out)
            except Exception:
                if out.error is not None:
                    raise out.error from None
                raise
            os.fsync(f.fileno())
        return {"size": out.size, "sha256": out.sha256.hexdigest()}

    def _publish(self, tmp: str, step: int) -> str:
        """Rename tmp to a checkpoint name of `step` that does not exist yet; return it.

        rename() fails on an existing non-empty directory, so a name another writer
        took first (even between our check and our rename) makes us take the next one.
        """
        directory = self.policy.directory
        for _ in range(100):
            versions = [v for s, v in _checkpoint_names(directory) if s == step]
            final = os.path.join(directory, mf.checkpoint_dirname(step, max(versions) + 1 if versions else 0))
            try:
                os.rename(tmp, final)
                return final
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
        raise OSError(errno.EEXIST, f"no free checkpoint name for step {step} in {directory}")

    def _refusal(self, job: _Job) -> str | None:
        """Why the write must not be (or stay) published: its round is over, or the
        directory is another job's now. None to publish."""
        return ownership.refusal(self.policy.directory, self.policy.job_id) or _publish_refusal(job)

    def _superseding(self, step: int) -> str | None:
        """Why publishing `step` would bury an earlier run's newer checkpoint, or None."""
        theirs = superseded_step(_checkpoint_names(self.policy.directory), step,
                                 resumed_from=self._resumed_from, published=self._published)
        if theirs is None:
            return None
        return (f"{theirs} in {self.policy.directory} is newer than step {self._resumed_from} this job "
                f"resumed from (an earlier run's): not superseding it")

    def _retract(self, final: str, tmp: str) -> None:
        """Take a just-published checkpoint back: renamed away first (loaders ignore a
        .tmp- name at once), then removed."""
        try:
            os.rename(final, tmp)
        except OSError as exc:
            logger.warning("cannot take back %s: %s", final, _describe(exc))
            return
        shutil.rmtree(tmp, ignore_errors=True)

    def _refused(self, message: str, step: int) -> None:
        self.last_error = message
        logger.warning(message)
        self._tell("checkpoint_failed", step=step, error=message)

    def _prune(self, own: str) -> None:
        """Keep the newest `keep` steps; delete only what is older than `own`
        (retention.names_to_prune: never a newer writer's, never an earlier run's above
        the step this job resumed from). A directory another job took over is not touched."""
        directory = self.policy.directory
        if ownership.refusal(directory, self.policy.job_id) is not None:
            return
        try:
            names = _checkpoint_names(directory)
        except OSError as exc:
            logger.warning("cannot list %s to prune old checkpoints: %s", directory, _describe(exc))
            return
        own_key = mf.parse_checkpoint_dirname(os.path.basename(own))
        for name in names_to_prune(names, own_key, self.policy.keep, resumed_from=self._resumed_from,
                                   published=self._published):
            path = os.path.join(directory, name)
            try:
                shutil.rmtree(path)
            except OSError as exc:
                logger.warning("cannot delete old checkpoint %s: %s", path, _describe(exc))

    def _fail(self, message: str, step: int | None = None) -> None:
        self.last_error = message
        logger.error(message)
        self._tell("checkpoint_failed", step=step, error=message)

    def _tell(self, name: str, **fields: Any) -> None:
        if self._report is None:
            return
        try:
            self._report(name, **fields)
        except Exception as exc:  # noqa: BLE001 - a broken report must not fail the write
            logger.debug("checkpoint report %s failed: %s", name, exc)


def _publish_refusal(job: _Job) -> str | None:
    """Why the write must not be published (its round is over), or None."""
    if job.still_current is None:
        return None
    try:
        if job.still_current():
            return None
        return f"its round {job.round} is over"
    except PublishRefusal as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - a publish check that cannot be made refuses
        return f"cannot tell whether its round {job.round} is current ({_describe(exc)})"


def _describe(exc: BaseException) -> str:
    """'[Errno 28] No space left on device: path' for OSError, 'Type: text' otherwise."""
    if isinstance(exc, OSError):
        return str(exc)
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
