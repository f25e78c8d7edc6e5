"""Collectives before ``@elastic.run`` on a joiner or a replacement: why they cannot run, in one line.

A script's code before its decorated function runs once per process. In the job's first
round every worker runs it together, on the ring that ``elastic.init()`` formed, so
"rank 0 downloads, then ``dist.barrier()``" works there. A worker that starts later (a
joiner, or the replacement of a lost worker) runs that code alone: the workers it will
train with are past it for good (mid-training in their ring, or waiting in the new
round for this worker to arrive) and will not run it again. So no ring can serve it:

* the new round's ring forms when this worker arrives, at its first sync
  (``recovery.py``'s first ring, in ``@elastic.run``). Entering it earlier, at the
  script's first collective, would pair that barrier with the others' first collective
  of the sync (the gather of what each holds): a mismatch that hangs or corrupts the
  sync of every survivor, for a barrier that has nobody to meet;
* making it a no-op would be worse: the script's "wait until rank 0 has downloaded"
  would silently not wait.

Such a worker therefore holds no process group before its first sync, and torch raises
at once ("Default process group has not been initialized", a prompt error, no hang).
``explain`` turns that error into one line that says what to do: move the code into the
decorated function, which every worker (re-)enters on every ring, or make it local
(``elastic.rank()`` and ``elastic.size()`` already hold the round's values). A DDP built
outside the function is the same case (its constructor broadcasts). It is the user's
error: the job fails once, at the first replacement, with that line, rather than hours
later for a reason nobody can read.
"""

from __future__ import annotations

import os
import traceback
from typing import Optional

import torch

from ..contract.errors import ElasticError

# torch's words when there is no default process group (distributed_c10d._get_default_group).
_NO_GROUP = "default process group has not been initialized"
# Frames of these packages are not where the user's code made the call.
_NOT_THE_CALLER = tuple(os.path.join(folder, "") for folder in (
    os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


class NoRingBeforeRun(ElasticError):
    """A collective (or a process-group call) before ``@elastic.run`` on a worker that joins a
    job under way: it has no ring until its first sync (see the module doc)."""


def explain(exc: BaseException, joining: Optional[int]) -> BaseException:
    """``exc``, or, when it is torch's "no process group" met by a worker that has not entered
    its ring yet (``joining``: the round it will enter at its first sync, else None), the
    one-line ``NoRingBeforeRun`` that says what to do instead."""
    if joining is None or not isinstance(exc, (ValueError, RuntimeError)) or _NO_GROUP not in str(exc).lower():
        return exc
    site = call_site(exc.__traceback__)
    return NoRingBeforeRun(
        f"a collective before @elastic.run{f' ({site})' if site else ''} cannot run on a worker joining the "
        f"job under way (round {joining}): the running workers never run that code again; move it into the "
        f"@elastic.run function (elastic.rank() and elastic.size() work before it)")


def call_site(tb) -> str:
    """``file.py:line`` of the innermost frame of ``tb`` in the user's code ("" if none)."""
    frames = [f for f in traceback.extract_tb(tb) if not f.filename.startswith("<")
              and not os.path.abspath(f.filename).startswith(_NOT_THE_CALLER)]
    return f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
