"""Test-only: a checkpoint directory whose checkpoints exist but cannot be read.

Put this directory first on PYTHONPATH (tests/fakes/jobs.py's ``env``) and name the
directory in ``STORAGE_FAULT_DIR``: in worker processes (the agent is left alone),
opening any file inside a ``step-*`` checkpoint for reading fails with EIO, as on an
NFS mount whose server has gone astray. Writing is untouched. The checkpoint loader's
retries are shortened (``STORAGE_FAULT_RETRY_DELAYS``, seconds, comma-separated) so
that a test need not wait the product's half minute.
"""

import builtins
import errno
import os

_DIR = os.environ.get("STORAGE_FAULT_DIR")

if _DIR and "ELASTIC_WORKER_WORKER_ID" in os.environ:  # WorkerConfig.worker_id
    _real_open = builtins.open
    _prefix = os.path.join(os.path.abspath(_DIR), "step-")

    def _open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and not any(c in mode for c in "wax+"):
            if os.path.abspath(os.fspath(file)).startswith(_prefix):
                raise OSError(errno.EIO, os.strerror(errno.EIO), os.fspath(file))
        return _real_open(file, mode, *args, **kwargs)

    builtins.open = _open

    delays = os.environ.get("STORAGE_FAULT_RETRY_DELAYS")
    if delays is not None:
        import elastic.checkpoint.restore

        elastic.checkpoint.restore.RETRY_DELAYS = tuple(float(d) for d in delays.split(",") if d)
