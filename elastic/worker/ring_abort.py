"""Wake every rank of a broken gloo ring at once, from another thread.

gloo has no working abort: ``ProcessGroupGloo.abort()``/``shutdown()`` and
``ProcessGroup.abort()`` return at once but leave an operation that is already
waiting for a peer blocked until the collective timeout (measured, torch 2.13).
Only the dead rank's ring neighbours see a broken socket; the other survivors
wait on live peers that are themselves stuck.

What does wake a gloo operation is an error on one of its TCP pairs. So
``RingHandle.abort()`` shuts this process's gloo connections down: gloo's event
loop reads end-of-stream, marks each pair failed and fails every pending and
future operation on it ("Connection closed by peer"), whether the caller waits on
a Work (``dist.all_reduce``) or on its Future (DDP's reducer). The read side is
shut first and the write side (the FIN that wakes the peers) only once gloo failed
the pair: shutting both at once lost a send issued in between, a 60 s stall
(ring_sockets.py). ``shutdown`` changes only the connection state; the
descriptors stay gloo's, so gloo closes them itself (no double close).

Which sockets are the ring's: the ones that appear across ``init_process_group``
(gloo connects its full mesh there). The caller takes a ``SocketSnapshot`` just
before init, or before connecting to the round's store to include the store's
client connection too, and hands it to ``prepare_ring``. Listening sockets are never
touched: shutting gloo's listener makes its accept loop terminate the process.
Every descriptor is re-checked by inode on a duplicate before the shutdown, so a
number that gloo closed and the OS handed to someone else is left alone.

Needs Linux or macOS (``/proc/self/fd`` or ``/dev/fd``). Other backends (NCCL)
have a real abort, which ``abort()`` calls as well (nccl_abort.py: every group of
the ring, on a thread of its own with a deadline).

``check_ring`` is asked by every commit before it overwrites the snapshot: NCCL
collectives do not block the host, so after an abort the queued optimizer step
has applied partial gradients, and only the ring's state says so.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import threading
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, Optional, Tuple

import torch
import torch.distributed as dist

from elastic.rendezvous import RoundPlan

from ..contract.console import FILE_ONLY
from ..contract.devices import uses_nccl
from . import nccl_abort, ring_sockets

log = logging.getLogger(__name__)

_FD_DIRS = ("/proc/self/fd", "/dev/fd")


@dataclass(frozen=True)
class SocketSnapshot:
    """The (fd, inode) pairs of this process's sockets at one moment."""

    sockets: FrozenSet[Tuple[int, int]]


def _fd_dir() -> str:
    for path in _FD_DIRS:
        if os.path.isdir(path):
            return path
    raise RuntimeError("ring_abort needs /proc/self/fd or /dev/fd to list this process's sockets")


def _open_sockets() -> Dict[int, int]:
    """fd -> inode for every socket this process has open."""
    found = {}
    for name in os.listdir(_fd_dir()):
        try:
            info = os.fstat(int(name))
        except (OSError, ValueError):  # closed meanwhile, or the directory's own fd
            continue
        if stat.S_ISSOCK(info.st_mode):
            found[int(name)] = info.st_ino
    return found


def socket_snapshot() -> SocketSnapshot:
    """Take this right before ``init_process_group`` (after creating the store)."""
    return SocketSnapshot(frozenset(_open_sockets().items()))


def _is_connected_tcp(fd: int) -> bool:
    dup = socket.socket(fileno=os.dup(fd))  # closing the duplicate leaves fd open
    try:
        if dup.family not in (socket.AF_INET, socket.AF_INET6) or dup.type != socket.SOCK_STREAM:
            return False
        return not dup.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    finally:
        dup.close()


def _shutdown_if_same(fd: int, inode: int) -> bool:
    """Shut the connection down if ``fd`` still names socket ``inode``."""
    try:
        dup_fd = os.dup(fd)
    except OSError:  # gloo closed it already
        return False
    # Checking on the duplicate pins the socket: no reuse of the number can slip in
    # between the check and the shutdown. The number may already name something else
    # (a file, a pipe: not a socket at all), so look before wrapping it in a socket.
    try:
        if os.fstat(dup_fd).st_ino != inode:
            os.close(dup_fd)
            return False
        dup = socket.socket(fileno=dup_fd)
    except OSError:  # not a socket after all: the wrapper did not take the number
        os.close(dup_fd)
        return False
    try:
        dup.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:  # already shut down or reset by the peer
        return False
    finally:
        dup.close()


def _connections_since(before: SocketSnapshot) -> FrozenSet[Tuple[int, int]]:
    """Connected TCP sockets opened since ``before`` (listeners excluded)."""
    return frozenset(
        (fd, inode)
        for fd, inode in _open_sockets().items()
        if (fd, inode) not in before.sockets and _is_connected_tcp(fd)
    )


def _peer_port(fd: int) -> Optional[int]:
    dup = socket.socket(fileno=os.dup(fd))
    try:
        return dup.getpeername()[1]
    except OSError:  # not connected (any more)
        return None
    finally:
        dup.close()


def shutdown_connections_to(before: SocketSnapshot, port: int) -> int:
    """Shut down the connected TCP sockets opened since ``before`` whose peer port is
    ``port``; how many (round_store.py: a store client stuck in its handshake)."""
    return sum(_shutdown_if_same(fd, inode) for fd, inode in _connections_since(before) if _peer_port(fd) == port)


class RingBroken(dist.DistBackendError):
    """The ring this commit's collectives ran on was aborted or reported an error: the
    step is not to be committed. A ``DistError``, hence a communication error for the
    recovery path (failures.py), which rolls back to the previous commit, left intact."""


def check_ring(ring: Optional["RingHandle"], *, device_sync: bool) -> None:
    """Raise RingBroken unless the collectives queued so far completed without error.

    ``device_sync``: wait for the current CUDA stream first (NCCL rings), so that an
    error or abort that hits a queued collective is visible before the caller goes on.
    """
    if device_sync and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()
    if ring is None:
        return
    if ring.aborted:
        raise RingBroken("the ring was aborted (a peer was lost): this step is not committed")
    error = ring.error()
    if error is not None:
        raise RingBroken(f"the ring reported {error}: this step is not committed")


def broken_reason(ring: Optional["RingHandle"]) -> Optional[str]:
    """Why ``ring`` is broken ("aborted", or the error its backend reports), or None."""
    if ring is None:
        return None
    return "aborted" if ring.aborted else ring.error()


def failed_reason(ring: Optional["RingHandle"]) -> Optional[str]:
    """Why ``ring`` failed, or None: ``broken_reason`` less an abort of a planned leave."""
    if ring is None or (ring.aborted and ring.left_by_plan):
        return None
    return broken_reason(ring)


class RingHandle:
    """Aborts one process group's ring from any thread; see the module docstring."""

    def __init__(self, connections: Optional[FrozenSet[Tuple[int, int]]], other_backend=None,
                 before: Optional[SocketSnapshot] = None, *, port: Optional[int] = None,
                 deadline_s: float = nccl_abort.ABORT_DEADLINE_S,
                 on_overrun: Callable[[str], None] = nccl_abort.exit_broken):
        # No reference to a gloo group: holding one would keep its sockets open after
        # destroy_process_group(). ``other_backend`` is a non-gloo backend (NCCL's) to
        # abort, with every group of the process, on a thread with ``deadline_s``.
        # ``connections`` None: a ring still forming, whose sockets are those new since
        # ``before`` at the time of the abort (see forming_ring); ``port``: only those
        # whose peer is that port (the round's store: NCCL's own sockets are NCCL's).
        self._connections = connections
        self._before = before
        self._port = port
        self._other_backend = other_backend
        self._watched = other_backend  # asked for its error state (NCCL) until forgotten
        self._uses_backend_abort = other_backend is not None
        self._deadline_s = deadline_s
        self._on_overrun = on_overrun
        self._abort_done: Optional[threading.Event] = None
        self._lock = threading.Lock()
        self._aborted = False
        self._left_by_plan = False  # aborted by a planned leave (no connection shut), not a failure
        self._forgotten = False

    @property
    def backend_abort(self) -> bool:
        """True for a ring whose backend has a real abort (NCCL), run off-thread."""
        return self._uses_backend_abort

    def _current_connections(self) -> FrozenSet[Tuple[int, int]]:
        # A forming ring's are found at the time of asking: its mesh grows meanwhile.
        if self._connections is not None:
            return self._connections
        found = _connections_since(self._before)
        if self._port is not None:
            found = frozenset((fd, inode) for fd, inode in found if _peer_port(fd) == self._port)
        return found

    @property
    def aborted(self) -> bool:
        return self._aborted

    @property
    def left_by_plan(self) -> bool:
        """The first abort was a planned leave's (``abort(sockets=False)``), not a failure's."""
        return self._left_by_plan

    def error(self) -> Optional[str]:
        """The backend's own error state, if it keeps one (NCCL's ``get_error()``), as a
        name ("TIMEOUT", "COMM_ERROR", "REMOTE_ERROR"); None while it reports none."""
        backend = self._watched
        get_error = getattr(backend, "get_error", None)
        if get_error is None:
            return None  # gloo (torch 2.13's ProcessGroupGloo has none), or forgotten
        try:
            kind = get_error()
        except RuntimeError as exc:  # a backend torn down under us: an error too
            return f"error state unreadable ({exc})"
        name = getattr(kind, "name", str(kind))
        return None if name == "SUCCESS" else name

    def abort(self, *, sockets: bool = True,
              backend_abort: Optional[Callable[[object], None]] = None) -> None:
        """Make every pending and future collective of the group raise now.

        Safe to call from any thread, more than once, and after the group was
        destroyed (then it does nothing). ``sockets`` False: the backend's abort alone,
        no connection shut (a planned leave, whose peers leave at the same commit).
        ``backend_abort(backend)``: what ends the backend's part instead of
        ``nccl_abort.abort_every_group`` (ring_shrink.shrink_then_abort: the default
        group's communicator shrunk first), on the same thread, under the same deadline.
        """
        with self._lock:
            if self._aborted or self._forgotten:
                return
            self._aborted = True
            self._left_by_plan = not sockets
            backend, self._other_backend = self._other_backend, None
        connections = self._current_connections() if sockets else frozenset()
        closed = ring_sockets.shut_reads(connections)  # reads now, writes once gloo failed the pair
        if backend is None:
            log.info("ring aborted: shut down %d of %d gloo connections", closed, len(connections), extra=FILE_ONLY)
            return
        # The round store's sockets first (a commit's look at the store must not block
        # on a host cut off), then NCCL's abort, which may block: off this thread.
        log.info("ring aborted: shut down %d store connection(s); aborting the NCCL groups", closed, extra=FILE_ONLY)
        end_backend = backend_abort or nccl_abort.abort_every_group
        self._abort_done = nccl_abort.run_with_deadline(
            lambda: end_backend(backend), self._deadline_s, self._on_overrun, "elastic-nccl-abort")

    def include_since(self, before: SocketSnapshot) -> None:
        """The connections made since ``before`` are the ring's too: sub-groups cut out of it
        after it formed (a hybrid mesh's lines, elastic/sharded/hybrid_mesh.py), whose
        collectives an abort must wake as well. Shut at once if the ring is aborted already."""
        new = _connections_since(before)
        with self._lock:
            if self._connections is None or self._forgotten:
                return
            self._connections = self._connections | new
            late = self._aborted and not self._left_by_plan
        if late:
            for fd, inode in new:
                _shutdown_if_same(fd, inode)

    def wait_aborted(self) -> bool:
        """Wait (bounded by the deadline) for a backend abort under way; True once done."""
        done = self._abort_done
        return done is None or done.wait(self._deadline_s)

    def forget(self) -> None:
        """Forget the group (call before destroying it); abort() becomes a no-op."""
        with self._lock:
            self._forgotten = True
            self._other_backend = None
            self._watched = None


def leave_ring(ring: Optional[RingHandle], *, failed: bool, round_number: int) -> None:
    """Forget ``ring`` and tear its process group down. A ring with a real abort (NCCL)
    is aborted, never destroyed, after a failure and at a planned switch alike:
    ``destroy_process_group`` finalizes its communicators, which waits for pending work
    and for the peers (up to TORCH_NCCL_NONBLOCKING_TIMEOUT), so a peer dying meanwhile
    would leave a ring that nothing can abort, the handle being gone already (TorchFT
    leaves by abort too; docs/gpus.md). The abort runs under its deadline whatever the
    peers do. A planned switch shuts no connection: its peers leave at the same commit,
    with nothing in flight. After a failure every ring, gloo's too, is aborted with its
    connections shut: peers still blocked in it on our connections fail at once (freeing
    the old pairs with a gc.collect() did the same, in 0.1-0.3 s on the recovery path of
    every survivor: issue 30). A group that cannot be torn down makes the worker exit as
    broken: the next init would fail as a user error ("default process group twice").
    A communicator the abort shrank for the next round (ring_shrink.py) is no group's:
    leaving the old groups leaves it alone."""
    backend_abort = ring is not None and ring.backend_abort
    if ring is not None and (failed or backend_abort):
        ring.abort(sockets=failed)  # a no-op if the control thread did it already
    if backend_abort:
        ring.wait_aborted()  # bounded: past its deadline the worker exits (nccl_abort.py)
    if ring is not None:
        ring.forget()
    if dist.is_initialized() and not backend_abort:
        try:
            dist.destroy_process_group()
        except Exception as exc:  # a broken group may complain on the way out
            log.debug("destroy_process_group: %s", exc)
    if dist.is_initialized() and not nccl_abort.leave_aborted():
        nccl_abort.exit_broken(f"round {round_number}: the old process group could not be torn down")


def forming_ring(before: SocketSnapshot, *, port: Optional[int] = None) -> RingHandle:
    """A handle on a ring whose ``init_process_group`` is under way: ``abort()`` shuts
    down the connections made since ``before`` (take it before connecting to the
    round's store). An init waiting in the store for a peer that died then fails at
    once instead of at the store's timeout (the collective timeout), and so does one
    that already connected part of gloo's mesh."""
    if not isinstance(before, SocketSnapshot):
        raise TypeError(f"before must be a SocketSnapshot from socket_snapshot(), got {type(before).__name__}")
    return RingHandle(None, before=before, port=port)


def prepare_ring(group=None, *, before: SocketSnapshot, store_port: Optional[int] = None) -> RingHandle:
    """Call right after ``init_process_group`` / ``new_group`` built ``group``.

    ``before`` is the ``socket_snapshot()`` taken just before that call; the
    sockets that are new since then and are connected TCP streams are gloo's pairs
    (gloo connects the full mesh during init). On NCCL the handle aborts the group's
    backend (and every other group) and shuts the connections to ``store_port``
    (the round's store) that are new since ``before``.
    """
    if not isinstance(before, SocketSnapshot):
        raise TypeError(f"before must be a SocketSnapshot from socket_snapshot(), got {type(before).__name__}")
    group = dist.group.WORLD if group is None else group
    if group is None:
        raise RuntimeError("prepare_ring: no process group; call it after init_process_group")
    name = str(dist.get_backend(group))
    # NCCL's real abort for its part ("nccl", "cpu:gloo,cuda:nccl"); other backends'
    # (mpi, ucc) own abort when they have no gloo part.
    other = group._get_backend(torch.device("cuda")) if uses_nccl(name) or "gloo" not in name else None
    if "gloo" not in name:
        store = frozenset()
        if store_port is not None:
            store = frozenset((fd, ino) for fd, ino in _connections_since(before) if _peer_port(fd) == store_port)
        return RingHandle(store, other_backend=other)
    new = _connections_since(before)
    peers = dist.get_world_size(group) - 1
    if len(new) < peers:  # (more is fine: the round's store client, if taken before it)
        # gloo's lazy init (TORCH_GLOO_LAZY_INIT) connects on first use; then abort
        # can only shut the connections that exist now.
        log.warning("prepare_ring: found %d gloo connections for %d peers", len(new), peers)
    # A gloo part next to NCCL's: every new connection is shut (gloo's mesh, the store's
    # and NCCL's bootstrap sockets: NCCL's abort needs none of them), then NCCL aborted.
    return RingHandle(new, other_backend=other)


def peer_lost(newer: Optional[RoundPlan], plan: RoundPlan) -> bool:
    """Does ``newer`` name a worker of ``plan`` lost? Only that tells a failed init of
    ``plan``'s ring from a network fault: a reset round (``recovers``, nobody lost) is
    what the first worker whose init failed asks for, whatever the cause."""
    return newer is not None and newer.round > plan.round and bool(set(newer.lost) & set(plan.worker_ids()))


def ring_breaks(newer: Optional[RoundPlan], plan: RoundPlan) -> bool:
    """Does ``newer`` say that ``plan``'s ring is broken: a worker of it lost, or a round
    formed to recover from a failure (a reset request names no one lost)? On NCCL nothing
    else wakes the others' kernels: a peer's own abort does not."""
    if newer is None or newer.round <= plan.round:
        return False
    return newer.recovers or bool(set(newer.lost) & set(plan.worker_ids()))


def forget_failed_init() -> None:
    """torch names process groups by a counter that only destroying the default group
    resets; a failed init took a number without making a group. Give it back, or our
    next group would be named unlike the same group in a fresh process (a joiner's):
    gloo's init keys carry the name, so the two would wait for each other in vain."""
    if not dist.is_initialized():
        from torch.distributed import distributed_c10d

        distributed_c10d._world.group_count = 0
