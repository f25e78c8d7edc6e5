"""One backend for the whole job: the first agent's choice, which every later agent uses.

``--backend auto`` is resolved on each host from its own GPUs (contract/devices.py). A
host that lost a GPU, or sees fewer through CUDA_VISIBLE_DEVICES, would pick gloo while
the others pick ``cpu:gloo,cuda:nccl``, and ranks that call ``init_process_group`` with
different backends never form a ring (gpu review G7). So the first agent records its
resolved backend in the job's keys (one create-if-absent transaction), and each later
agent compares: the same backend is fine; any difference refuses to start with one line.
That includes a GPU host in a job recorded as gloo (gpu review N9): it could run gloo, but
a first host that saw no GPU per worker (a lost one, CUDA_VISIBLE_DEVICES) would then turn
the whole GPU job into a gloo one, several times slower, without a word. A job meant for
gloo says so with ``--backend gloo`` on every host, and then every host records and reads gloo.
The record hangs on the job lease (rendezvous/job_lease.py), like the plans, so that
the key of a job whose agents all died expires with the job's other keys. A record on
another lease is an ended job's history (history.py): a new job of that id starts afresh.
"""

from __future__ import annotations

import json
from typing import Optional

from elastic.rendezvous import ConfigError, Etcd, JobKeys
from elastic.rendezvous.etcd import CreateRevisionEquals, ModRevisionEquals, Put
from elastic.rendezvous import RendezvousError
from elastic.rendezvous.job_lease import ensure_job_lease, lease_missing
from elastic.rendezvous.keys import JOB_LEASE_S

from ..contract.devices import CPU_AND_CUDA


def agree(mine: str, recorded: Optional[tuple[str, str]]) -> str:
    """The backend this host's workers use: ``mine`` (this host's resolved one) when it is
    the job's ``recorded`` one (backend, host that chose it) or none is recorded, else
    ConfigError (one line)."""
    if recorded is None or recorded[0] == mine:
        return mine
    theirs, host = recorded
    remedy = "fix the host or give --backend gloo to every host"
    if theirs == "gloo" and mine == CPU_AND_CUDA:
        # This host was not given --backend gloo (that resolves to gloo, never to this), and
        # the first host may have been a degraded GPU host: running gloo here would be silent.
        why = (f"this GPU host would run on gloo, several times slower, unasked (host {host} may see no GPU "
               f"for each of its workers: CUDA_VISIBLE_DEVICES, a lost GPU?)")
        remedy = f"fix host {host}, or give --backend gloo to every host to run the job on gloo"
    elif mine == "gloo" and theirs == CPU_AND_CUDA:
        why = "this host cannot give each of its workers a GPU of its own (CUDA_VISIBLE_DEVICES, a lost GPU?)"
    else:
        why = "every host of a job must use one backend"
    raise ConfigError(f"--backend: the job runs {theirs} (chosen by host {host}) but this host resolved {mine}: "
                      f"{why}; {remedy}")


def settle(etcd: Etcd, keys: JobKeys, mine: str, host: str, *, deadline: float = 30.0,
           abandoned_after: float = JOB_LEASE_S) -> str:
    """Record ``mine`` as the job's backend if none is, and return the one to use (``agree``)."""
    record = json.dumps({"backend": mine, "host": host}).encode()
    for _ in range(5):  # another agent may write between our read and our write: read again
        # The coordinator takes the same lease when it starts to lead (ensure_job_lease finds it).
        lease = ensure_job_lease(etcd, keys, abandoned_after)
        kv = etcd.get(keys.backend, retry_deadline=deadline)
        if kv is not None and kv.lease in (0, lease):  # 0: written before the job lease existed
            found = json.loads(kv.value)
            return agree(mine, (found["backend"], found.get("host", "?")))
        compare = CreateRevisionEquals(keys.backend, 0) if kv is None else ModRevisionEquals(keys.backend,
                                                                                             kv.mod_revision)
        try:
            written, _ = etcd.txn([compare], [Put(keys.backend, record, lease=lease)], retry_deadline=deadline)
        except RendezvousError as exc:
            if not lease_missing(exc):  # the job lease went (an ended job's history): take a new one
                raise
            continue
        if written:
            return mine
    raise ConfigError(f"--backend: could not agree on the job's backend in etcd ({keys.backend} keeps changing)")

