"""Where a launcher keeps the job's secrets on disk, and how they go when it does, even by SIGKILL.

The launcher and its etcd write files that must not outlive the job: the job's CA and
the etcd password handed to workers, a served etcd member's server key, a job secret
it generated. ``atexit`` removes them on a normal exit, not after a SIGKILL (the OOM
killer, a node agent, ``kill -9``). So:

- every such file lives in this process's own directory, ``process_dir()``: a 0700
  directory under a root of the user's, ``elastic-run-<uid>`` (0700) in
  ``$ELASTIC_PRIVATE_ROOT``, else in the temporary directory, or in ``$XDG_RUNTIME_DIR``
  when another user took that name first (security review 2, L8). The root is always
  that dedicated directory, never the one the variable names: a sweep there once
  removed a user's own directories and chmod-ed a home directory (review 2, M6). It must
  be node-local: the sweep trusts ``flock``, which some shared filesystems keep per node;
- a reaper, a background ``sh`` reading a pipe whose write end only this process holds,
  removes that directory, and any path given to ``register``, when the pipe closes:
  when this process ends, however it ends. It runs in its own session and is not this
  process's child, so a signal to the launcher's process group does not take it along;
- if the reaper was killed too (a whole container or namespace gone), the next launcher
  of the same user removes every directory under the root whose owner is gone: each
  holds a ``lock`` file its owner keeps ``flock``ed, which the kernel releases on death.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import re
import shutil
import stat
import subprocess
import tempfile
import threading
from typing import Optional

from .errors import ConfigError

ROOT_ENV = "ELASTIC_PRIVATE_ROOT"
_LOCK = "lock"
_NAME = re.compile(r"[0-9]+-[a-z0-9_]{8}")  # what process_dir makes: "<pid>-" and mkdtemp's 8 characters
# Reads one path per line until the pipe closes (its owner ended), then removes them all.
# Started in the background by a shell that exits at once: the reaper is nobody's child
# (the launcher keeps no process of its own); the pipe reaches it as fd 3, since a
# background list's standard input is /dev/null.
_REAPER = ('exec 3<&0; (while IFS= read -r p; do set -- "$@" "$p"; done; rm -rf -- "$@") <&3 '
           '>/dev/null 2>&1 &')

_guard = threading.Lock()
_dir: Optional[str] = None
_lock_fd: Optional[int] = None
_reaper: Optional[subprocess.Popen] = None


def private_root(environ=os.environ) -> str:
    """The user's directory of per-process private directories (created 0700); ConfigError
    (one line) when there is none of this user's to be had."""
    chosen = environ.get(ROOT_ENV)
    parents = [chosen] if chosen else [tempfile.gettempdir(), environ.get("XDG_RUNTIME_DIR")]
    refusals = []
    for parent in filter(None, parents):
        root = os.path.join(parent, f"elastic-run-{os.getuid()}")
        refusal = _own_directory(root)
        if refusal is None:
            return root
        refusals.append(refusal)
    raise ConfigError(f"no private directory: {'; '.join(refusals)} (set {ROOT_ENV} to a node-local "
                      f"directory of yours; elastic-run-{os.getuid()} is made in it)")


def _own_directory(root: str) -> Optional[str]:
    """Make ``root`` (0700) or check the one there; why it cannot be ours, or None."""
    try:
        os.makedirs(os.path.dirname(root), mode=0o700, exist_ok=True)  # a parent made here: 0700 too
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        return f"cannot create {root}: {exc.strerror or exc}"
    info = os.lstat(root)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        return f"{root} is not a directory of this user's"
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(root, 0o700)  # ours by name and owner: made by us, loosened since
    return None


def sweep(root: str) -> list[str]:
    """Remove the directories under ``root`` whose owner process is gone (their lock is
    free); the names removed. Only names ``process_dir`` makes, holding a regular file
    ``lock``, are looked at: nothing else under the root is ever touched."""
    removed = []
    for name in sorted(os.listdir(root)):
        if not _NAME.fullmatch(name):
            continue  # being set up (a dot first), or not one of ours
        path = os.path.join(root, name)
        try:
            fd = os.open(os.path.join(path, _LOCK), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue  # being created (no lock yet), or not one of ours
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue  # a directory or a FIFO named lock: not one of ours
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # held: its owner is alive
        finally:
            os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(name)
    return removed


def process_dir() -> str:
    """This process's private directory (0700), removed when the process ends, SIGKILL included."""
    global _dir, _lock_fd, _reaper
    with _guard:
        if _dir is not None:
            return _dir
        root = private_root()
        sweep(root)
        # Locked under a name the sweep skips (dot), then renamed: no sweep ever finds
        # its lock free while we live.
        hidden = tempfile.mkdtemp(prefix=f".{os.getpid()}-", dir=root)
        fd = os.open(os.path.join(hidden, _LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # held until this process ends (the fd is not inherited)
        path = os.path.join(root, os.path.basename(hidden)[1:])
        os.rename(hidden, path)
        _reaper = subprocess.Popen(["/bin/sh", "-c", _REAPER, "elastic-reaper"], stdin=subprocess.PIPE,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True,
                                   start_new_session=True, cwd="/")
        _reaper.wait(10)  # the shell that put the reaper in the background
        _dir, _lock_fd = path, fd
        _send(path)
        atexit.register(_remove)
        return path


def register(path: str) -> None:
    """Remove ``path`` too when this process ends (a file it created outside its directory)."""
    process_dir()
    with _guard:
        _send(os.path.abspath(path))


def _send(path: str) -> None:
    if "\n" in path:
        raise ConfigError(f"a private path may not contain a newline: {path!r}")
    try:
        _reaper.stdin.write(path.encode() + b"\n")
        _reaper.stdin.flush()
    except (OSError, ValueError):
        pass  # the reaper is gone: atexit and the next start's sweep remain


def _remove() -> None:
    if _dir is not None:
        shutil.rmtree(_dir, ignore_errors=True)
