"""What Slurm knows, as elastic-run's defaults: the job id, this node's name, workers per node, the rendezvous.

Under ``srun`` every task sees the allocation in its environment (``SLURM_JOB_ID``,
``SLURMD_NODENAME``, ``SLURM_JOB_NODELIST``, ...). ``defaults`` turns that into the
options a user would otherwise repeat on every node, as a pure function of the
environment (tested as a table); ``apply`` fills only the options the user left out,
so an explicit option or its ``ELASTIC_*`` form always wins.

The rendezvous, when no ``--rdzv-endpoint`` is given: the agent on the allocation's
first node starts an embedded etcd on that node's address, at a port derived from
the job id (``RDZV_PORT_BASE + id % RDZV_PORT_SPAN``, so two jobs sharing a node
rarely collide), and the other nodes reach it there. It lives and dies with that
node: a production job points every allocation at an external etcd instead.

That etcd speaks TLS and wants a password, both derived from a per-job secret
(rendezvous/job_secret.py): ``ELASTIC_JOB_SECRET`` or ``ELASTIC_JOB_SECRET_FILE`` when
the job gives one, else one the first node generates into a 0600 file under
``$ELASTIC_JOB_SECRET_DIR`` (default ``~/.elastic-run/secrets``, on the shared home
directory) that the other nodes read once the first node's etcd listens. Other users
of the cluster can compute the port but cannot talk to the etcd; a process of theirs
squatting the port does not hold the job's certificate and is refused in one line.

A requeued job keeps its Slurm id; its default job id gets ``-r<SLURM_RESTART_COUNT>``
appended, so an external etcd still holding the ended first run's status (kept a day
for ``elastic-run status``) does not end the new run at once. Training state comes
back from ``--checkpoint-dir``, not from etcd.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import re
import socket
import threading
import time
from dataclasses import dataclass
from typing import Mapping, Optional

from elastic.rendezvous import ConfigError, EmbeddedEtcd, RendezvousError
from elastic.rendezvous.job_secret import SECRET_FILE_ENV, new_secret, read_secret_file, secret_from_env, \
    write_secret_file
from elastic.rendezvous.private_files import register
from elastic.rendezvous.tls_probe import TlsFiles, tls_refusal

from .etcd_secrets import expect_job_secret, use_job_secret

log = logging.getLogger(__name__)

RDZV_PORT_BASE = 27000
RDZV_PORT_SPAN = 2000
# Other nodes start at once with the first one: how long they wait for its etcd to listen.
WAIT_FOR_EMBEDDED_S = 120.0


@dataclass(frozen=True)
class SlurmDefaults:
    """Option defaults that Slurm's environment gives; ``serve_rendezvous``: this task starts the etcd."""

    job_id: str
    host_id: str
    nproc_per_node: Optional[int]
    rdzv_endpoint: str
    serve_rendezvous: bool


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list ("gpu[07-09,12],cpu1" -> "gpu07"), as
    ``scontrol show hostnames`` would print it first; each bracket takes its first
    number, keeping its zero padding."""
    head = re.match(r"(?:[^,\[]|\[[^\]]*\])+", nodelist.strip())
    if not head:
        raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r}: not a Slurm host list")
    return re.sub(r"\[([^\],-]*)[^\]]*\]", lambda m: m.group(1), head.group(0))


def _count(text: Optional[str]) -> Optional[int]:
    """The first count of a Slurm per-node list ("4(x3),2" -> 4, "2" -> 2); None if absent."""
    match = re.match(r"\s*(\d+)", text or "")
    return int(match.group(1)) if match else None


def _nproc(env: Mapping[str, str]) -> Optional[int]:
    """Workers per node: the node's GPUs, else the job's tasks per node when the step
    runs one elastic-run per node (each runs the node's workers), else one."""
    gpus = _count(env.get("SLURM_GPUS_ON_NODE"))
    if gpus:
        return gpus
    step_tasks = _count(env.get("SLURM_STEP_TASKS_PER_NODE"))
    if step_tasks is not None and step_tasks > 1:
        return 1  # several elastic-runs per node: one worker each
    tasks = _count(env.get("SLURM_NTASKS_PER_NODE"))
    return tasks if tasks else None


def defaults(env: Mapping[str, str]) -> Optional[SlurmDefaults]:
    """The defaults of a task of a Slurm job step, or None outside Slurm."""
    job = env.get("SLURM_JOB_ID")
    node = env.get("SLURMD_NODENAME")
    if not job or not node:
        return None  # not a Slurm task (a login shell inside salloc has no SLURMD_NODENAME)
    if not job.isdigit():
        raise ConfigError(f"SLURM_JOB_ID={job!r}: expected a number")
    restarts = _count(env.get("SLURM_RESTART_COUNT")) or 0
    job_id = f"slurm-{job}" + (f"-r{restarts}" if restarts else "")
    several_here = (_count(env.get("SLURM_STEP_TASKS_PER_NODE")) or 1) > 1
    local = env.get("SLURM_LOCALID", "0")
    host_id = f"{node}-{local}" if several_here else node
    first = first_host(env.get("SLURM_JOB_NODELIST") or node)
    port = RDZV_PORT_BASE + int(job) % RDZV_PORT_SPAN
    return SlurmDefaults(
        job_id=job_id, host_id=host_id, nproc_per_node=_nproc(env),
        rdzv_endpoint=f"{first}:{port}", serve_rendezvous=node == first and local == "0",
    )


def apply(args: argparse.Namespace, env: Mapping[str, str]) -> None:
    """Fill the options the user left out from Slurm's environment (parse's hook).

    With an explicit endpoint nothing is served; an explicit job id (a second
    allocation joining the first one's job) wins over the Slurm one.
    """
    found = defaults(env)
    if found is None:
        return
    # "serve": start the job's etcd here; "reach": wait for the first node's; None: the user's endpoint.
    args.slurm_rendezvous = None
    if not args.rdzv_endpoint:
        args.rdzv_endpoint = found.rdzv_endpoint
        args.slurm_rendezvous = "serve" if found.serve_rendezvous else "reach"
    if not args.job_id and found.job_id != f"slurm-{env['SLURM_JOB_ID']}":
        # A requeued run of the job (its own id, -r<N>) takes over its checkpoint directory.
        args.checkpoint_take_over = True
    args.job_id = args.job_id or found.job_id
    if args.slurm_rendezvous and not (getattr(args, "etcd_ca", None) or getattr(args, "etcd_user", None)):
        # The job's own etcd: its credentials come from the job secret once serve_rendezvous has it.
        given = getattr(args, "job_secret_file", None) or env.get(SECRET_FILE_ENV)  # --job-secret-file too
        args.slurm_secret = secret_from_env({**env, SECRET_FILE_ENV: given} if given else env)
        args.slurm_secret_file = given or default_secret_file(env, args.job_id)
        expect_job_secret(args)  # the file paths the workers will get; serve_rendezvous writes them
    args.host_id = args.host_id or found.host_id
    if args.nproc_per_node is None:
        args.nproc_per_node = found.nproc_per_node


def default_secret_file(env: Mapping[str, str], job_id: str) -> str:
    """Where the first node leaves a generated job secret for the others (shared home).
    The name holds the allocation and its restart count whatever ``--job-id`` says: two
    allocations resuming one job id once shared the file, and the first to end deleted
    the other's secret (security review 2, L1)."""
    directory = env.get("ELASTIC_JOB_SECRET_DIR") or os.path.join(os.path.expanduser("~"), ".elastic-run", "secrets")
    allocation = env.get("SLURM_JOB_ID", "")
    restart = env.get("SLURM_RESTART_COUNT", "0")
    run = f"{allocation}-r{restart}" if restart not in ("", "0") else allocation
    own = not allocation or job_id in (f"slurm-{allocation}", f"slurm-{run}")  # Slurm's own job ids name it
    return os.path.join(directory, f"{job_id}.secret" if own else f"{job_id}@{run}.secret")


def serve_rendezvous(args: argparse.Namespace) -> Optional[EmbeddedEtcd]:
    """main's hook: on the first node, start the embedded etcd the others will reach
    (returned, for main to stop); on the others, wait until it listens and prove that
    it is the job's (its certificate chains to the job's CA)."""
    how = getattr(args, "slurm_rendezvous", None)
    if how is None:
        return None  # not under Slurm, or the user's own endpoint
    host, port = args.rdzv_endpoint.rsplit(":", 1)
    secured = hasattr(args, "slurm_secret")
    if how == "serve":
        try:
            address = socket.gethostbyname(host)
        except OSError as exc:
            raise RendezvousError(f"cannot resolve this node's name {host} for the job's embedded etcd: {exc}") from None
        security, joins = None, ""
        if secured:
            secret = args.slurm_secret
            if secret is None:
                secret = new_secret()
                try:
                    os.makedirs(os.path.dirname(args.slurm_secret_file), mode=0o700, exist_ok=True)
                    write_secret_file(args.slurm_secret_file, secret, exclusive=True)
                    register(args.slurm_secret_file)  # gone with this process, even a SIGKILLed one
                except OSError as exc:
                    raise RendezvousError(f"cannot write the job secret {args.slurm_secret_file}: "
                                          f"{exc.strerror or exc} (or set ELASTIC_JOB_SECRET)") from None
            security = use_job_secret(args, secret)
            args.etcd_password = security.password
            joins = f" and {SECRET_FILE_ENV}={args.slurm_secret_file}" if args.slurm_secret is None else \
                " and the same ELASTIC_JOB_SECRET"
        etcd = _StepEtcd(host=address, port=int(port), security=security, server_names=(host,))
        if secured and args.slurm_secret is None:  # removed at stop only while it is still the one written here
            etcd.generated_secret = (args.slurm_secret_file, _digest(args.slurm_secret_file))
        etcd.start()
        etcd.keep_up()
        log.info("embedded etcd for the Slurm job at %s (%s%s); another allocation joins with "
                 "--rdzv-endpoint %s --job-id %s%s", args.rdzv_endpoint, address, ", TLS and auth" if secured else "",
                 args.rdzv_endpoint, args.job_id, joins)
        return etcd
    deadline = time.monotonic() + WAIT_FOR_EMBEDDED_S
    _wait_for_listener(host, int(port), WAIT_FOR_EMBEDDED_S)
    if secured:
        secret = args.slurm_secret or _wait_for_secret(args.slurm_secret_file, deadline)
        security = use_job_secret(args, secret)
        args.etcd_password = security.password
        refusal = tls_refusal(host, int(port), TlsFiles(args.etcd_ca), timeout=5.0)
        if refusal is not None:
            raise RendezvousError(f"the listener at {host}:{port} is not this job's etcd, refused: {refusal} "
                                  f"(another process on the port?)")
    return None


def _digest(path: str) -> Optional[str]:
    """The SHA-256 of a small file's bytes (symlinks not followed), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return hashlib.sha256(os.read(fd, 1 << 16)).hexdigest()
    finally:
        os.close(fd)


def _wait_for_secret(path: str, deadline: float) -> str:
    """The secret the first node generated (it writes the file before its etcd listens)."""
    while True:
        try:
            return read_secret_file(path)
        except ConfigError as exc:
            if os.path.exists(path) or time.monotonic() > deadline:
                raise RendezvousError(f"{exc} (the first node writes it; without a shared home directory set "
                                      f"ELASTIC_JOB_SECRET in the batch script)") from None
        time.sleep(0.2)


class _StepEtcd(EmbeddedEtcd):
    """The job's embedded etcd, started again on its data whenever it exits before stop().

    Slurm signals every process of a step: the SIGTERM that makes the agents leave
    gracefully (preemption, the time limit, scancel) also reaches this etcd, which
    would shut down under the agents still stopping the job at a commit. Started again
    on the same data and port, the clients ride out the gap (their requests retry).
    """

    def keep_up(self) -> None:
        self._guard = threading.Lock()
        self._stopping = False
        # Restarted from this thread, which lives as long as the process: the etcd child
        # dies with the thread that started it (PR_SET_PDEATHSIG).
        threading.Thread(target=self._watch, name="slurm-etcd-keeper", daemon=True).start()

    def _watch(self) -> None:
        while True:
            time.sleep(0.2)
            with self._guard:
                if self._stopping:
                    return
                if self.running:
                    continue
                log.warning("the job's embedded etcd exited (the step's SIGTERM?): starting it again on its data")
                try:
                    self.restart()
                except RendezvousError as exc:
                    log.warning("cannot start the embedded etcd again: %s", exc)

    generated_secret = None  # (path, digest) of the secret file this node wrote: it goes with the etcd

    def stop(self) -> None:
        if self.generated_secret:
            path, digest = self.generated_secret
            if _digest(path) == digest:
                try:
                    os.unlink(path)
                except OSError:
                    pass
        guard = getattr(self, "_guard", None)
        if guard is None:
            super().stop()
            return
        with guard:
            self._stopping = True
            super().stop()


def _wait_for_listener(host: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=2.0).close()
            return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise RendezvousError(f"the job's embedded etcd at {host}:{port} (first node of the allocation) "
                                  f"did not answer within {timeout:g}s: {exc}") from None
            time.sleep(0.2)
