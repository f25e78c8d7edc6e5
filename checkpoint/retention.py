"""What a writer may delete or supersede in a checkpoint directory: decisions as plain
functions (``names_to_prune``, ``superseded_step``), and the removal of the tmp dirs of
writers that are gone. Shared by the plain writer (durable.py) and the sharded one
(elastic/sharded/durable.py), so that both prune by name and never read a checkpoint
back to decide.

Two writers may share a directory for a while (an old rank 0 still writing while a new
one starts), and a run may resume from an older step than the directory's newest (the
newer ones were corrupt, or unreadable and a fresh start was allowed). So:

* a tmp dir names its writer (host and pid); it is removed only when that process is
  gone, or, for a writer on another host (or of unknown name), when the dir has not
  changed for ``STALE_TMP_SECONDS``;
* a prune deletes only checkpoints older than the one its writer just published, and
  never an earlier run's checkpoint above the step the writer's job resumed from;
* a writer never publishes a rewrite of such a step (``step-N.1``, which loaders prefer).
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import time
from typing import AbstractSet, Optional

from . import manifest as mf

__all__ = ["STALE_TMP_SECONDS", "checkpoint_names", "names_to_prune", "remove_stale_tmps", "superseded_step"]

# A tmp dir whose writer cannot be checked (another host, an unnamed writer) is stale
# after this long without a change. Generous: a live writer changes its file all the
# time while it writes, and a whole write of many GB takes minutes.
STALE_TMP_SECONDS = 3600.0
_TMP_OWNER = re.compile(r"@(?P<host>[^@:/]+):(?P<pid>\d+)$")

Key = tuple[int, int]  # (step, version)


def checkpoint_names(directory: str) -> dict[Key, str]:
    """(step, version) -> name of every published checkpoint in `directory` (by name only)."""
    found = {}
    for name in os.listdir(directory):
        key = mf.parse_checkpoint_dirname(name)
        if key is not None:
            found[key] = name
    return found


def names_to_prune(names: dict[Key, str], own: Key, keep: int, *, resumed_from: Optional[int] = None,
                   published: AbstractSet[str] = frozenset()) -> list[str]:
    """The checkpoints to delete once ``own`` is published: beyond the newest ``keep``
    steps, or an older copy of a rewritten step; only ever older than ``own``; never an
    earlier run's (not in ``published``) above ``resumed_from``."""
    doomed, steps_seen = [], set()
    for key, name in sorted(names.items(), reverse=True):
        superseded = key[0] in steps_seen
        steps_seen.add(key[0])
        if key >= own or not (superseded or len(steps_seen) > keep):
            continue
        if resumed_from is not None and key[0] > resumed_from and name not in published:
            continue
        doomed.append(name)
    return doomed


def superseded_step(names: dict[Key, str], step: int, *, resumed_from: Optional[int],
                    published: AbstractSet[str] = frozenset()) -> Optional[str]:
    """The name of an earlier run's checkpoint that publishing ``step`` would supersede
    (it is above ``resumed_from``, and not this writer's), or None."""
    if resumed_from is None or step <= resumed_from:
        return None
    theirs = sorted(name for (s, _), name in names.items() if s == step and name not in published)
    return theirs[0] if theirs else None


def remove_stale_tmps(directory: str) -> None:
    """Remove the tmp dirs (``.tmp-*``) of writers that are gone. OSError if the
    directory cannot be listed."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name.startswith(mf.TMP_PREFIX) and _tmp_is_stale(name, path):
            shutil.rmtree(path, ignore_errors=True)


def _tmp_is_stale(name: str, path: str) -> bool:
    """Is this tmp dir the leftover of a writer that is gone?"""
    owner = _TMP_OWNER.search(name)
    if owner is not None and owner["host"] == socket.gethostname():
        if not _process_alive(int(owner["pid"])):
            return True
        # Alive, or its pid was reused: only age can tell then.
    try:
        changed = max([os.stat(path).st_mtime] + [e.stat().st_mtime for e in os.scandir(path)])
    except OSError:
        return False  # vanished meanwhile (published or removed by its writer)
    return time.time() - changed > STALE_TMP_SECONDS


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has stopped writing
    except (OSError, IndexError):
        return True
