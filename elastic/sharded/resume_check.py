"""Which durable checkpoint a sharded resume takes, and its checksums verified during the load.

A resume verifies a checkpoint in two steps. Rank 0 picks the newest one whose manifest
parses and whose files have the sizes it records (a stat each: ``newest_for_resume``),
while every other rank waits for its answer as long as a durable load may take
(``agree_on_newest``). Then every rank loads its shards and meanwhile reads the sha256
of its share of the files (``load_verified``); the training resumes only once every
share matched, and a checkpoint whose bytes do not is left for the next older one, on
every rank alike. So a checkpoint is still verified, every byte, before the training
goes on from it, but by every rank in parallel with the load rather than by rank 0 alone
before anyone may start (1 TB: 10-20 minutes, longer than --collective-timeout).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from typing import Callable, Optional, Sequence, TypeVar

from elastic.checkpoint import CheckpointPolicy, CheckpointsUnreadable
from elastic.checkpoint import manifest as mf
from elastic.checkpoint import restore
from elastic.checkpoint.restore import find_newest, with_retries

from ..contract.errors import ElasticError
from ..state import UNREADABLE_ADVICE, durable_load_wait
from . import meta_wire
from .durable import FORMAT, ShardedCheckpoints

log = logging.getLogger(__name__)
T = TypeVar("T")


def newest_valid(directory: str, *, skip_unreadable: bool = False, hashes: bool = True,
                 rejected: Sequence[str] = (), **retries) -> Optional[tuple[str, dict]]:
    """(path, manifest) of the newest complete sharded checkpoint whose checksums hold
    (``hashes=False``: whose files have their sizes), leaving out the paths ``rejected``.

    Checkpoints that cannot be read are scanned for again, then ``CheckpointsUnreadable``
    (checkpoint/restore.py) names them, unless ``skip_unreadable``. ``retries``:
    ``with_retries``'s ``delays`` and ``sleep``."""
    def sharded(info) -> Optional[str]:
        if info.path in rejected:
            return "it did not verify when it was loaded"
        return None if (info.manifest.get("meta") or {}).get("format") == FORMAT else "not a sharded (DCP) checkpoint"

    found = with_retries(lambda: find_newest(directory, accept=sharded, skip_unreadable=skip_unreadable,
                                             hashes=hashes), **retries)
    return (found[0].path, found[0].manifest) if found is not None else None


def newest_for_resume(policy: CheckpointPolicy, rejected: Sequence[str] = ()) -> Optional[tuple[str, dict]]:
    """Rank 0 at a resume: ``newest_valid`` per the policy, by the manifests and the files'
    sizes only: every other rank waits for the answer, and reading every byte of a
    checkpoint of 1 TB takes 10-20 minutes. The checksums are verified during the load
    (``load_verified``). Unreadable checkpoints fail the job (exit 1)."""
    try:
        return newest_valid(policy.directory, skip_unreadable=policy.skip_unreadable, hashes=False,
                            rejected=rejected)
    except CheckpointsUnreadable as exc:
        raise CheckpointsUnreadable(exc.directory, exc.unreadable, advice=UNREADABLE_ADVICE) from None


def agree_on_newest(ring, checkpoints: Optional[ShardedCheckpoints],
                    rejected: Sequence[str] = ()) -> Optional[tuple[str, dict]]:
    """Rank 0's ``newest_for_resume`` (None without checkpoints) on every rank of ``ring``
    (a ``RingView``). The others wait for it as long as ``State.sync``'s receivers wait for
    a durable load, not --collective-timeout: a directory on a slow file server may take
    longer to scan."""
    found = None
    if checkpoints is not None and ring.rank == 0:
        found = newest_for_resume(checkpoints.policy, rejected)
    return meta_wire.broadcast_found(found, ring.rank, ring.world_size, ring.backend, wait_s=durable_load_wait(ring))


def resume_from_newest(ring, checkpoints: Optional[ShardedCheckpoints], load: Callable[[tuple[str, dict]], Optional[T]],
                       *, lost: Optional[str]) -> Optional[T]:
    """``load(found)`` of the newest durable checkpoint whose checksums verify at its load,
    on every rank of ``ring`` alike: ``load`` returns None when they do not (every rank
    alike, ``load_verified``), and the next older one is tried. None when there is none.
    ``lost``: why the ring needs one ("every copy of a shard of commit 12 is lost ..."),
    which makes "none" an error and each resume a warning; None at the job's first start."""
    rejected: list[str] = []  # checkpoints whose checksums did not verify at their load
    while True:
        found = agree_on_newest(ring, checkpoints, rejected)
        if checkpoints is not None:  # the directory's steps above it are an earlier run's
            checkpoints.resumed_from = int(found[1]["step"]) if found is not None else -1
        if found is None:
            if lost is not None:
                raise ElasticError(f"{lost} and there is no durable checkpoint" + (" that verifies" if rejected else ""))
            return None
        if lost is not None:
            log.warning("round %d: %s: resuming from durable checkpoint step %s in %s",
                        ring.round, lost, found[1]["step"], found[0])
        resumed = load(found)
        if resumed is not None:
            return resumed
        rejected.append(found[0])


# A durable load's verification verdicts, worst last (meta_wire.worst_verdict sends the worst).
VERIFIED, CORRUPT, UNREADABLE = 0, 1, 2
_DCP_DATA = re.compile(r"^__(\d+)_\d+\.distcp$")  # DCP's data file of the rank that wrote it


def hash_shares(files: dict[str, dict], world: int) -> list[list[str]]:
    """Which rank of ``world`` verifies the checksum of which of a checkpoint's ``files``
    (the manifest's). DCP's data file of rank k goes to rank k % world: at the same world
    size that is the file the rank reads itself, which its load has just brought into
    the page cache. The other files go one by one, largest first, to the rank with the
    fewest bytes so far (the lowest on a tie)."""
    shares: list[list[str]] = [[] for _ in range(world)]
    load = [0] * world
    others = []
    for name in sorted(files):
        match = _DCP_DATA.match(name)
        if match is None:
            others.append(name)
            continue
        rank = int(match.group(1)) % world
        shares[rank].append(name)
        load[rank] += files[name]["size"]
    for name in sorted(others, key=lambda n: (-files[n]["size"], n)):
        rank = min(range(world), key=lambda r: (load[r], r))
        shares[rank].append(name)
        load[rank] += files[name]["size"]
    return shares


class ShareVerification:
    """The checksums of ``names`` (files of the checkpoint at ``path``), verified on a thread
    of its own while the load reads the checkpoint: hashlib and file reads release the
    GIL, so the two overlap. ``result()``: (verdict, reason or None)."""

    def __init__(self, path: str, manifest: dict, names: Sequence[str]):
        self._stop = threading.Event()
        self._outcome: tuple[int, Optional[str]] = (VERIFIED, None)
        self._thread = threading.Thread(target=self._run, args=(path, manifest, list(names)),
                                        name="checkpoint-verify", daemon=True)
        self._thread.start()

    def _run(self, path: str, manifest: dict, names: list[str]) -> None:
        for name in names:
            if self._stop.is_set():  # the load failed for another reason: no need to read on
                return
            reason = self._verify(path, manifest, name)
            if reason is not None:
                self._outcome = reason
                return

    def _verify(self, path: str, manifest: dict, name: str) -> Optional[tuple[int, str]]:
        """One file's verdict; a read that fails is tried again as the scan does
        (restore.RETRY_DELAYS: a file server's failover passes)."""
        for delay in (*restore.RETRY_DELAYS, None):
            try:
                reason = mf.verify_files(path, manifest, names=[name])
                return (CORRUPT, reason) if reason is not None else None
            except mf.ManifestUnreadable as exc:
                if delay is None or self._stop.is_set():
                    return UNREADABLE, str(exc)
                log.warning("durable checkpoint %s: %s; retrying in %g s", path, exc, delay)
                if self._stop.wait(delay):
                    return UNREADABLE, str(exc)
            except Exception as exc:  # noqa: BLE001 - a checksum that cannot be computed is no verdict of corruption
                return UNREADABLE, f"cannot verify {name}: {exc}"
        return None

    def result(self) -> tuple[int, Optional[str]]:
        self._thread.join()
        return self._outcome

    def cancel(self) -> None:
        self._stop.set()


def load_verified(ring, found: tuple[str, dict], load: Optional[Callable[[], T]],
                  skip_unreadable: bool) -> tuple[bool, Optional[T]]:
    """``load()`` (None: this rank loads nothing, a spare) of the checkpoint ``found``, while
    this rank verifies its share of the checkpoint's checksums (``hash_shares``); every rank
    of ``ring`` calls it. (True, its value) once every rank's share matched; (False, None),
    on every rank alike, when one did not: the caller tries an older checkpoint, the
    loaded state is not used. A file that could not be read fails the job
    (``CheckpointsUnreadable``), unless ``skip_unreadable``, which takes it as a mismatch.

    The checksums are read here rather than before rank 0 names the checkpoint: every
    other rank waits for that answer, and the checksums of 1 TB take one reader 10-20
    minutes, a share of them about as long as the load. A truncated file never gets
    here (``newest_for_resume`` checks the sizes), and a file whose bytes are wrong is
    refused before the training resumes from it."""
    path, manifest = found
    verification = ShareVerification(path, manifest, hash_shares(manifest["files"], ring.world_size)[ring.rank])
    try:
        try:
            value = load() if load is not None else None
        except Exception:
            # DCP carries one rank's failure to every rank (its collectives gather errors), so
            # every rank is here alike. A mismatch explains the failure: try an older checkpoint.
            if _worst(ring, verification, path, skip_unreadable) == VERIFIED:
                raise
            return False, None
        if _worst(ring, verification, path, skip_unreadable) != VERIFIED:
            return False, None
        return True, value
    finally:
        verification.cancel()


def _worst(ring, verification: ShareVerification, path: str, skip_unreadable: bool) -> int:
    verdict, reason = verification.result()
    if reason is not None:
        log.warning("durable checkpoint %s does not verify: %s", path, reason)
    worst = meta_wire.worst_verdict(verdict, ring.rank, ring.world_size, ring.backend, durable_load_wait(ring),
                                    codes=UNREADABLE + 1)
    if worst == UNREADABLE and not skip_unreadable:
        raise CheckpointsUnreadable(os.path.dirname(path), [(path, "a file could not be read to verify its checksum")],
                                    advice=UNREADABLE_ADVICE)
    if worst != VERIFIED and ring.rank == 0:
        log.warning("durable checkpoint %s does not verify on every rank (its files' checksums): "
                    "not resuming from it", path)
    return worst
