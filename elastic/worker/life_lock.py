"""Know that a worker on this host is dying the moment it starts to, not when it is gone.

A SIGKILLed (or crashed) worker closes its sockets, and its agent's ``waitpid``
returns, only after the kernel has torn its address space down: on the 2-core VMs
of BENCHMARKS.md that takes 0.05-0.4 s for a process that imported torch (measured:
0.1-0.25 s, against 2 ms for a bare Python), the largest part of "notice" in
``benchmarks.recovery``. The kernel releases a dying thread's robust futexes before
that teardown (``exit_mm`` -> ``futex_exit_release``): a process-shared robust mutex
that the worker's main thread holds for its whole life is handed on, with
``EOWNERDEAD``, to whoever waits for it as soon as the worker begins to exit.

``hold(path)``: the owner creates the mutex in a file (under a temporary name,
renamed once it is locked, so nobody ever sees it unlocked) and locks it from the
main thread. ``watch(path, on_death)``: a daemon thread blocks on the lock, using no
CPU, and calls ``on_death()`` once the owner's process is exiting (any exit, a clean
one too: the caller tells them apart; the holder never unlocks it). Linux with glibc only; elsewhere, or if
anything fails, ``hold`` and ``watch`` return False and the exit is seen as before.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import sys
import threading
from typing import Callable, Optional

log = logging.getLogger(__name__)

_SIZE = 64  # >= sizeof(pthread_mutex_t) (40 on x86_64, 48 on aarch64)
_PTHREAD_PROCESS_SHARED = 1
_PTHREAD_MUTEX_ROBUST = 1
_LIBC: list = []  # [libc or None], looked up once


def _libc():
    if not _LIBC:
        _LIBC.append(_load_libc())
    return _LIBC[0]


def _load_libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        ptr, num = ctypes.c_void_p, ctypes.c_int
        for name, args in (("pthread_mutexattr_init", [ptr]), ("pthread_mutexattr_setpshared", [ptr, num]),
                           ("pthread_mutexattr_setrobust", [ptr, num]), ("pthread_mutex_init", [ptr, ptr]),
                           ("pthread_mutex_lock", [ptr]), ("pthread_mutex_unlock", [ptr]),
                           ("pthread_mutex_consistent", [ptr])):
            getattr(libc, name).argtypes = args
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ptr, ctypes.c_size_t, num, num, num, ctypes.c_long]
        return libc
    except (OSError, AttributeError):  # no glibc (musl has robust mutexes too, but untested)
        return None


def _map(libc, fd: int) -> int:
    """Map the lock's file shared, never to be unmapped: an interpreter that exits
    cleanly frees its objects (a Python ``mmap`` would be unmapped), and the kernel
    can then no longer read the mutex off the dying thread's robust list."""
    addr = libc.mmap(None, _SIZE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap of the life lock failed")
    return addr


def hold(path: str) -> bool:
    """Create a robust mutex at ``path`` and lock it from this thread (the main thread:
    it lives as long as the process) until the process ends. True if held."""
    libc = _libc()
    if libc is None or threading.current_thread() is not threading.main_thread():
        return False
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, _SIZE)
            addr = _map(libc, fd)
        finally:
            os.close(fd)
        attr = ctypes.create_string_buffer(64)
        ok = (libc.pthread_mutexattr_init(attr) == 0
              and libc.pthread_mutexattr_setpshared(attr, _PTHREAD_PROCESS_SHARED) == 0
              and libc.pthread_mutexattr_setrobust(attr, _PTHREAD_MUTEX_ROBUST) == 0
              and libc.pthread_mutex_init(addr, attr) == 0
              and libc.pthread_mutex_lock(addr) == 0)
        if not ok:
            os.unlink(tmp)
            return False
        os.rename(tmp, path)  # seen by watchers only now: locked
    except OSError as exc:
        log.debug("life lock %s not held: %s", path, exc)
        return False
    return True


def watch(path: str, on_death: Callable[[], None], name: str = "elastic-life-watch") -> bool:
    """Call ``on_death()`` from a daemon thread once the holder of ``path`` is exiting.
    False if there is nothing to watch (no such lock, or no robust mutexes here)."""
    libc = _libc()
    if libc is None:
        return False
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        addr = _map(libc, fd)
    except OSError:
        return False
    finally:
        os.close(fd)

    def wait() -> None:
        rc = libc.pthread_mutex_lock(addr)  # ctypes lets go of the GIL meanwhile
        # The holder never unlocks: whoever gets the lock, with EOWNERDEAD (the first
        # watcher) or 0 (each next one, once the one before passed it on), gets it
        # because the holder is exiting. Marked consistent and unlocked at once, so
        # that every watcher, of every process, is woken in turn.
        if rc == errno.EOWNERDEAD:
            libc.pthread_mutex_consistent(addr)
        if rc in (0, errno.EOWNERDEAD):
            libc.pthread_mutex_unlock(addr)
        if rc in (0, errno.EOWNERDEAD, errno.ENOTRECOVERABLE):
            on_death()

    threading.Thread(target=wait, name=name, daemon=True).start()
    return True  # (64 bytes stay mapped: the thread may block on them until the holder exits)


def path_for(directory: str, worker_id: str) -> str:
    """The life lock of ``worker_id`` in its agent's scratch directory."""
    return os.path.join(directory, f"{worker_id}.life")


def holder_file(marker_file: Optional[str], worker_id: str) -> Optional[str]:
    """Where this worker's life lock lives: next to its agent's marker files."""
    return path_for(os.path.dirname(marker_file), worker_id) if marker_file else None
