"""The command the launcher prints for joining its job: one that works as printed.

It repeats the job's size (a joiner without --np or --min-np is refused) and the
script with its arguments; with the embedded etcd on 127.0.0.1 it says that it
works from this machine only, and how to run across hosts.
"""

from __future__ import annotations

import os
import shlex
from typing import Sequence

from elastic.rendezvous import RendezvousSettings

LOOPBACK_HOSTS = ("127.", "localhost", "[::1]", "::1")


def join_command(endpoint: str, job_id: str, settings: RendezvousSettings, command: Sequence[str],
                 secret_words: Sequence[str] = ()) -> str:
    """``elastic-run ...`` that adds one worker on another agent to the job at ``endpoint``.

    ``command``: the workers' (SCRIPT ARGS, or -m MODULE ARGS); a script's path is made
    absolute, so the command works from any directory. ``secret_words``: how the joiner
    is given the job's secret (``--job-secret-file PATH``), if it needs one."""
    command = list(command)
    if command and command[0] != "-m":
        command[0] = os.path.abspath(command[0])
    words = ["elastic-run", "--rdzv-endpoint", endpoint, "--job-id", job_id, *secret_words,
             "--min-np", str(settings.min_np), "--max-np", str(settings.max_np), *command]
    return shlex.join(words)


def join_hint(endpoint: str, job_id: str, settings: RendezvousSettings, command: Sequence[str],
              workers_here: int, secret: tuple[Sequence[str], str] = ((), "")) -> str:
    """The launcher's line about joining (the embedded etcd at ``endpoint``); ``secret``:
    etcd_secrets.secret_source's words for the command and the note on what to do first."""
    words, note = secret
    text = f"embedded etcd at {endpoint}; join with: {join_command(endpoint, job_id, settings, command, words)}"
    if note:
        text += f" ({note})"
    if workers_here >= settings.max_np:
        text += f" (it waits as a spare while the job has its --max-np {settings.max_np} workers)"
    if endpoint.startswith(LOOPBACK_HOSTS):
        text += ("; this etcd listens on loopback, so that works from this machine only (another terminal): "
                 "to run on several hosts, give every host --rdzv-endpoint HOST:PORT --job-id NAME, "
                 "HOST one host's address: that host serves the rendezvous (docs/deploy/bare-metal.md)")
    return text
