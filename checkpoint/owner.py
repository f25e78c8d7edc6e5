"""Which job a checkpoint directory belongs to, so that two jobs never share one.

    <dir>/job.json    {"job_id": "my-job", "claimed": <unix time>}

Two jobs given the same ``--checkpoint-dir`` would each publish rewrites of the other's
steps (``step-N.1``, which loaders prefer) and prune the other's checkpoints. So the
first job to use a directory claims it; a job of another id is refused (one line),
unless it takes the directory over explicitly (a new job id that resumes an ended
job's checkpoints: ``claim(..., take_over=True)``). A writer checks the claim right
before and right after it publishes (durable.py): once another job took the
directory over, the old job's late writes are not published and it prunes nothing.
"""
from __future__ import annotations

import errno
import json
import os
import stat
import secrets
import time
from typing import Optional

from . import manifest as mf

__all__ = ["OWNER_NAME", "DirectoryTaken", "claim", "owner_of", "refusal"]

OWNER_NAME = "job.json"
_MAX_CLAIM = 4096  # a claim is a job id and a time: more is not one


class DirectoryTaken(ValueError):
    """The directory belongs to another job; str() is one line saying what to do."""


def owner_of(directory: str) -> Optional[str]:
    """The job id that claimed ``directory``, or None if none did (a missing or an
    unparsable claim: an unparsable one is refused by ``claim``, which rewrites it only
    when taking over). OSError if the claim cannot be read."""
    path = os.path.join(directory, OWNER_NAME)
    # Not followed if a link, never blocking (a FIFO), a regular file only, read bounded:
    # job.json -> /dev/zero exhausted memory and a FIFO blocked every publish (review 2, L2).
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None  # a symlink is no claim (claim() refuses it unless taking over)
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        raw = os.read(fd, _MAX_CLAIM + 1)
    finally:
        os.close(fd)
    if len(raw) > _MAX_CLAIM:
        return None
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    job_id = record.get("job_id") if isinstance(record, dict) else None
    return job_id if isinstance(job_id, str) else None


def claim(directory: str, job_id: str, *, take_over: bool = False) -> None:
    """Record that ``directory`` belongs to ``job_id``; ``DirectoryTaken`` if another job
    holds it and ``take_over`` is not given. Creates the directory (0700) if needed."""
    os.makedirs(directory, mode=mf.DIR_MODE, exist_ok=True)
    current = owner_of(directory)
    if current == job_id:
        return
    if current is not None and not take_over:
        raise DirectoryTaken(
            f"checkpoint directory {directory} belongs to job {current!r} (its {OWNER_NAME}): run that job "
            f"with --job-id {current}, or take its checkpoints over with --checkpoint-take-over once it has ended")
    if current is None and not take_over and os.path.exists(os.path.join(directory, OWNER_NAME)):
        raise DirectoryTaken(f"checkpoint directory {directory}: its {OWNER_NAME} is not a job's claim; "
                             f"remove it, or pass --checkpoint-take-over")
    _write_claim(directory, job_id)


def refusal(directory: str, job_id: Optional[str]) -> Optional[str]:
    """Why a writer of ``job_id`` must not publish into ``directory`` now, or None.
    A directory nobody claimed is anybody's (a writer used without elastic-run)."""
    if job_id is None:
        return None
    try:
        current = owner_of(directory)
    except OSError as exc:
        return f"cannot read the directory's {OWNER_NAME} ({exc.strerror or exc})"
    if current is not None and current != job_id:
        return f"job {current!r} took the checkpoint directory over"
    return None


def _write_claim(directory: str, job_id: str) -> None:
    """Whole or absent: written aside, then renamed over any previous claim."""
    # Not a .tmp- name: the writers' stale-tmp cleanup removes directories only.
    tmp = os.path.join(directory, f".{OWNER_NAME}.{secrets.token_hex(4)}.part")
    try:
        with mf.open_private(tmp, "w", encoding="utf-8") as f:
            json.dump({"job_id": job_id, "claimed": time.time()}, f)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, os.path.join(directory, OWNER_NAME))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    mf.fsync_dir(directory)
