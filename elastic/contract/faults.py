"""Why a worker ended, in one vocabulary: the worker writes it, its agent reads it.

A ``Fault`` is what a failure means, decided once by the classifier
(``elastic/worker/failures.py classify``) and then carried as data:

    ring      the ring broke (a peer died, the network dropped, the ring was aborted):
              the survivors re-form it in their running processes
    network   the workers of a round could not connect to each other (an address or
              a firewall): nobody is dropped, the agent asks for another round
    process   this process cannot go on (a sticky CUDA error, out of memory, a device
              that no longer answers): its agent replaces it
    user      an error in the user's code: running it again would meet it again
    budget    the ring kept breaking beyond ``--max-resets``: the job fails, not as
              the user's error
    storage   the storage failed the job (checkpoints that exist cannot be read):
              the job fails, not as the user's error (a later run may pass)

A worker leaves one ``ExitRecord`` in its record file (one JSON object) before it
ends: ``finished`` when the training function returned, else the fault that ended
it. The agent decides the worker's fate from that record (``agent/fate.py``), never
from the wording of a message or an exit status alone.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

RING, NETWORK, PROCESS, USER, BUDGET, STORAGE = "ring", "network", "process", "user", "budget", "storage"
KINDS = (RING, NETWORK, PROCESS, USER, BUDGET, STORAGE)

# A record is a few hundred bytes; anything much larger was not written by a worker.
_MAX_RECORD_BYTES = 64 * 1024


@dataclass(frozen=True)
class Fault:
    kind: str  # one of KINDS
    reason: str  # one line naming the error ("OutOfMemoryError: ...")

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}")

    @property
    def reforms(self) -> bool:
        """The ring re-forms in the running processes (a broken ring, or peers that
        could not connect): not this process's fault, nor the user's."""
        return self.kind in (RING, NETWORK)


@dataclass(frozen=True)
class ExitRecord:
    """How a worker ended, as its agent reads it: finished, or ended by ``fault``."""

    finished: bool = False  # the training function returned on this worker
    fault: Optional[Fault] = None

    def to_json(self) -> str:
        body: dict = {"finished": self.finished}
        if self.fault is not None:
            body.update(kind=self.fault.kind, reason=self.fault.reason)
        return json.dumps(body)

    @classmethod
    def from_json(cls, text: str) -> Optional["ExitRecord"]:
        """The record, or None for text that is not one (an empty or torn file)."""
        try:
            body = json.loads(text)
        except ValueError:
            return None
        if not isinstance(body, dict) or not isinstance(body.get("finished", False), bool):
            return None
        fault = None
        if "kind" in body:
            kind, reason = body.get("kind"), body.get("reason", "")
            if kind not in KINDS or not isinstance(reason, str):
                return None
            fault = Fault(kind, reason)
        return cls(finished=body.get("finished", False), fault=fault)


def write_record(path: str, record: ExitRecord) -> None:
    """Leave ``record`` at ``path`` whole or not at all (the agent may read it the moment
    the process is gone, and a process may be killed while writing)."""
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        f.write(record.to_json() + "\n")
    os.replace(partial, path)


def read_record(path: str) -> Optional[ExitRecord]:
    """The record a worker left at ``path``, or None when it left none (or no valid one)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_RECORD_BYTES + 1)
    except OSError:
        return None
    if len(raw) > _MAX_RECORD_BYTES:
        return None
    return ExitRecord.from_json(raw.decode(errors="replace"))
