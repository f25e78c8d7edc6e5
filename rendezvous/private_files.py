"""Where a launcher keeps the job's secrets on disk, and how they go when it does, even by SIGKILL.

The launcher and its etcd write files that must not outlive the job: the job's CA and
the etcd password handed to workers, a served etcd member's server key, a job secret
it generated. ``atexit`` removes them on a normal exit, not after a SIGKILL (the OOM
killer, a node agent, ``kill -9``). So:

- every such file lives in this process's own directory, ``process_dir()``: a 0700
  directory under a root of the user's (``$ELASTIC_PRIVATE_ROOT``, else
  ``<tmp>/elastic-run-<uid>``, 0700, refused if another user owns it);
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
import shutil
import stat
import subprocess
import tempfile
import threading
from typing import Optional

from .errors import ConfigError

ROOT_ENV = "ELASTIC_PRIVATE_ROOT"
_LOCK = "lock"
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
    """The user's directory of per-process private directories (created 0700)."""
    root = environ.get(ROOT_ENV) or os.path.join(tempfile.gettempdir(), f"elastic-run-{os.getuid()}")
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        info = os.lstat(root)
    except OSError as exc:
        raise ConfigError(f"cannot create the private directory {root}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise ConfigError(f"{root} is not a directory of this user's (set {ROOT_ENV} to one that is)")
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(root, 0o700)
    return root


def sweep(root: str) -> list[str]:
    """Remove the directories under ``root`` whose owner process is gone (their lock is
    free); the names removed."""
    removed = []
    for name in sorted(os.listdir(root)):
        if name.startswith("."):
            continue  # being set up
        path = os.path.join(root, name)
        try:
            fd = os.open(os.path.join(path, _LOCK), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue  # being created (no lock yet), or not one of ours
        try:
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
