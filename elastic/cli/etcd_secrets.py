"""Where the etcd password and the job secret come from, and how they stay out of sight.

The password is read from ``--etcd-password-file`` (``ELASTIC_ETCD_PASSWORD_FILE``), a
0600 file of the user's. ``--etcd-password`` (or ``ELASTIC_ETCD_PASSWORD``) still works,
with a warning when it is on the command line, where ``ps`` shows it to every user of
the host. Workers are never given the password itself: they get the path of a 0600 file
(the user's, or one the agent writes into its private directory), and the agent removes
``ELASTIC_ETCD_PASSWORD`` and ``ELASTIC_JOB_SECRET`` from what they inherit
(``INHERITED_SECRETS``, agent/worker_env.py).

A password without TLS would cross the network in cleartext, and an ``https://``
endpoint without a CA would silently be spoken to in plaintext: both are refused in
one line unless ``--allow-insecure``.

A job secret (``ELASTIC_JOB_SECRET``, or the file ``--job-secret-file`` /
``ELASTIC_JOB_SECRET_FILE`` names; rendezvous/job_secret.py) with an explicit
``--rdzv-endpoint`` means "the job's own etcd, started with that secret": the CA, user
and password come from it, and an etcd this host serves for the job is secured with it.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from typing import Optional, Sequence

from elastic.rendezvous import ConfigError
from elastic.rendezvous.private_files import process_dir
from ..contract.worker_config import INHERITED_SECRETS
from elastic.rendezvous.job_secret import (
    SECRET_ENV,
    JobSecret,
    client_paths,
    read_private_file,
    read_secret_file,
    secret_from_env,
    write_private_file,
)

log = logging.getLogger(__name__)

assert SECRET_ENV in INHERITED_SECRETS
_private_dir: Optional[str] = None


def private_dir() -> str:
    """This process's 0700 directory for secrets handed to its workers: removed when the
    process ends, by SIGKILL too (rendezvous/private_files.py)."""
    global _private_dir
    if _private_dir is None:
        _private_dir = tempfile.mkdtemp(prefix="secrets-", dir=process_dir())
    return _private_dir


def password_on_command_line(argv: Sequence[str]) -> bool:
    return any(a == "--etcd-password" or a.startswith("--etcd-password=") for a in argv)


def _https(endpoints: str) -> bool:
    return any(item.strip().lower().startswith("https://") for item in (endpoints or "").split(","))


def check_transport(*, endpoints: str, ca: Optional[str], password: bool, allow_insecure: bool) -> None:
    """ConfigError (one line) for a set-up that would leak the password or ignore TLS."""
    if allow_insecure or ca:
        return
    if _https(endpoints):
        raise ConfigError(f"--rdzv-endpoint {endpoints} asks for TLS but no --etcd-ca was given: give the CA that "
                          f"signed etcd's certificate (or --allow-insecure to speak plaintext)")
    if password:
        raise ConfigError("an etcd password without TLS would cross the network in cleartext: give --etcd-ca "
                          "(or --allow-insecure)")


def resolve_password(args: argparse.Namespace, argv: Sequence[str] = ()) -> None:
    """Set ``args.etcd_password`` (read from the file) and ``args.etcd_password_file``
    (a 0600 file for the workers), and check the transport. Idempotent."""
    if getattr(args, "_password_resolved", False):
        return
    file = getattr(args, "etcd_password_file", None)
    if file and args.etcd_password:
        raise ConfigError("give --etcd-password-file or --etcd-password, not both")
    if file:
        args.etcd_password = read_private_file(file, "--etcd-password-file")
        if not args.etcd_password:
            raise ConfigError(f"--etcd-password-file {file} is empty")
    elif args.etcd_password:
        if password_on_command_line(argv):
            log.warning("--etcd-password on the command line is visible to every user of this host (ps): use "
                        "--etcd-password-file or ELASTIC_ETCD_PASSWORD_FILE")
        args.etcd_password_file = write_private_file(os.path.join(private_dir(), "etcd-password"),
                                                     args.etcd_password.encode())
    if args.rdzv_endpoint:
        check_transport(endpoints=args.rdzv_endpoint, ca=args.etcd_ca, password=bool(args.etcd_password),
                        allow_insecure=bool(getattr(args, "allow_insecure", False)))
    args._password_resolved = True


def expect_job_secret(args: argparse.Namespace) -> None:
    """Point the etcd options at the files ``use_job_secret`` will write (the secret is
    not known yet: Slurm's other nodes read it once the first node's etcd listens)."""
    files = client_paths(private_dir())
    args.etcd_ca, args.etcd_user, args.etcd_password_file = files.ca_cert, files.user, files.password_file
    args._password_resolved = True  # use_job_secret sets the password itself


def use_job_secret(args: argparse.Namespace, secret: str) -> JobSecret:
    """The job's etcd credentials from ``secret``: CA, user and password files in the private dir."""
    js = JobSecret(secret)
    files = js.client_files(private_dir())
    args.etcd_ca, args.etcd_user, args.etcd_password_file = files.ca_cert, files.user, files.password_file
    args.etcd_password = None
    args.job_secret = js  # a served etcd's members and its steward (root) need more than the files
    return js


def apply_job_secret(args: argparse.Namespace, environ=os.environ) -> None:
    """parse's hook: a job secret in the environment with the user's own endpoint (not
    Slurm's, which slurm.py handles) gives the etcd credentials, unless the user gave some."""
    if getattr(args, "slurm_rendezvous", None) or not args.rdzv_endpoint:
        return
    file = _secret_file(args, environ)
    secret = read_secret_file(file) if file else secret_from_env(environ)
    if secret is None:
        return
    if args.etcd_ca or args.etcd_user:
        log.warning("%s ignored: --etcd-ca/--etcd-user given", SECRET_ENV)
        return
    use_job_secret(args, secret)


def _secret_file(args: argparse.Namespace, environ=os.environ) -> Optional[str]:
    """The secret file the job's secret is read from: --job-secret-file (or its
    ELASTIC_JOB_SECRET_FILE), unless the secret itself is in ELASTIC_JOB_SECRET, which wins."""
    file = getattr(args, "job_secret_file", None)
    return file if file and not environ.get(SECRET_ENV) else None


def secret_source(args: argparse.Namespace) -> tuple[list[str], str]:
    """What another host's command needs to reach this job's etcd (words for the join
    hint) and what to do first (a note, or ""): the secret file's path (the user copies
    it), the same secret in the environment, or --allow-insecure as this host was given."""
    if getattr(args, "job_secret", None) is not None:
        file = _secret_file(args)
        if file:
            path = os.path.abspath(file)
            return ["--job-secret-file", path], f"copy {path} to every host first, mode 0600"
        return [], f"with the same {SECRET_ENV} in its environment"
    if getattr(args, "allow_insecure", False):
        return ["--allow-insecure"], ""
    return [], ""
