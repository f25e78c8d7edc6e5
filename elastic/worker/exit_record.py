"""Where this worker tells its agent how it ended (``contract/faults.py``): one writer.

The path comes from the agent (``WorkerConfig.error_file``); without an agent there is
nobody to tell, and every write is a no-op. The last record written is the one read:
a worker that finished and then failed in its clean-up ends with the failure.

"Finished" means the training function returned. A script that trains under
``@elastic.run`` finishes when that function returns, never by exiting 0 some other
way (``os._exit(0)`` or ``sys.exit(0)`` mid-training, a stop at a commit): its agent
must not take such an exit for the job's success. A script that never enters
``@elastic.run`` (Horovod's plain ``hvd.init()`` scripts) has only its own end to
go by: its interpreter's normal exit (``at_exit``) is its finish, as for torchrun.
"""

from __future__ import annotations

import logging
from typing import Optional

from ..contract.faults import ExitRecord, Fault, write_record

log = logging.getLogger(__name__)

_path: Optional[str] = None
_trains_under_run = False  # @elastic.run was entered: only its return is a finish
_written = False  # a record (a finish or a fault) was left


def report_to(path: Optional[str]) -> None:
    global _path
    _path = path


def training_started() -> None:
    global _trains_under_run
    _trains_under_run = True


def trains_under_run() -> bool:
    """Whether ``@elastic.run`` was entered (Horovod's shim asks: a collective before it)."""
    return _trains_under_run


def at_exit() -> None:
    """The interpreter exits normally: the finish of a script that never used
    ``@elastic.run`` (an uncaught exception has left its fault first)."""
    if not _trains_under_run and not _written:
        _write(ExitRecord(finished=True))


def finished() -> None:
    """The training function returned: the only ending that counts as the job's success."""
    _write(ExitRecord(finished=True))


def failed(fault: Fault) -> None:
    _write(ExitRecord(fault=fault))


def _write(record: ExitRecord) -> None:
    global _written
    _written = True
    if _path is None:
        return
    try:
        write_record(_path, record)
    except OSError as exc:  # the agent then sees an exit without a record: a crash
        log.error("cannot write the exit record %s: %s", _path, exc)
