"""Progress marks: how a worker tells its agent, without a syscall per step, that it moves.

Each worker owns one small file in its agent's scratch directory, mapped into
memory by both (``ProgressBoard``). Two writers in the worker, one reader (the
agent's watchdog, see ``watchdog.py``), no locks: every field is an aligned
8-byte slot written by one thread only, and a torn ``where`` text is harmless.

* The main thread bumps the *progress* counter at ``state.commit()`` and when
  the training function is (re-)entered on a ring (``Ring.begin``). A commit
  also records the interval since the previous mark of the same round, and the
  slowest such interval: the agent scales its patience to it. The interval
  ending at a round's first commit is not recorded (it holds the re-formation,
  DDP's first broadcast, warm-up).
* A ``Heartbeat`` thread bumps the *alive* counter every 0.25 s. SIGSTOP (a
  hung driver, NFS, a debugger) freezes every thread, so a silent heartbeat
  means a frozen process. It also looks at where the main thread is
  (``classify``): blocked inside a collective or the runtime's own waits
  (waiting on peers: a victim of somebody else's hang), or in user code, and
  whether it used the CPU since the last beat. It records since when the main
  thread has been seen idle in user code without progress (sleeping, blocked on
  a lock or a socket), and where; the agent calls a long such stretch a stuck
  main thread. Busy user code (an evaluation pass, a long computation) is never
  such a stretch: it is slow, not stuck.

A commit also counts itself and adds its interval to a running total: the
agent's metrics (``agent/metrics.py``) read commits and step time from there.

The per-step cost is one ``time.monotonic()`` and four ``struct.pack_into``
into the mapping: no system call (the kernel writes the page back when it likes).

The worker also asks ``faulthandler`` to dump every thread's stack into a file
on SIGUSR1: the agent asks for it before it kills a worker it declared hung.

Beside that file a worker whose torch has NCCL writes NCCL's flight recorder on the
same signal (``NcclTrace``; gpu review gpu-3 N13): the collectives each of its groups
queued, started and completed, which tells the rank a GPU hang began on from the ranks
waiting for it. faulthandler's handler is C code and runs no Python, and a Python
signal handler runs only on the main thread, which a hang holds in C code (a stream
sync). So the heartbeat thread notices the stack file grow and a thread of its own
writes the dump: the recorder's lock may be held by NCCL's stuck watchdog, and no
heartbeat may wait for it.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import mmap
import os
import signal
import struct
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

BOARD_SIZE = 256
# Slots (little-endian, 8 bytes each), then the text of ``where``.
_PROGRESS, _PROGRESS_AT, _SLOWEST, _BEATS, _ALIVE_AT, _USER_SINCE = 0, 8, 16, 24, 32, 40
_COMMITS = 48  # then steps (56) and step_total (64): for the agent's metrics (agent/metrics.py)
_METRICS_SLOTS = struct.Struct("<QQd")  # commits, steps, step_total
_WHERE_LEN = 72
_DEVICE_SINCE = 80  # device work (a CUDA event recorded at a commit) pending since then; 0: none
# Sharded state (elastic/sharded/): when the newest commit's copies to its replica holders
# were posted (main thread) and when the last of them completed (the replication thread).
_REPLICA_POSTED, _REPLICA_DONE = 88, 96
_WHERE = 104
_WHERE_MAX = BOARD_SIZE - _WHERE

HEARTBEAT_INTERVAL = 0.25  # seconds between heartbeats; the agent's bounds are >= 1 s

# Modules whose frames mean "waiting on others": collectives (also inside DDP's forward
# and backward, and CUDA syncs that wait for NCCL kernels), the runtime's own waits for
# rounds and stores, and a DataLoader waiting on its worker processes (it notices dead
# ones itself, and restarting them at an epoch boundary takes seconds). A main thread
# stuck there is a victim, not a culprit.
WAITING_MODULES = (
    "torch.distributed", "torch.nn.parallel", "torch.autograd", "torch.cuda", "torch.utils.data",
    "elastic",  # the runtime's own rooms, rendezvous and checkpoint included
)
# Libraries our rendezvous calls (etcd's client and its retries): like the standard
# library they do not decide; the frame that called them does (ours while re-forming
# through an etcd outage, the user's if a script calls them itself).
PASS_THROUGH_MODULES = ("tenacity", "grpc", "etcd3")
BUSY_SHARE = 0.1  # main-thread CPU time per wall time above which it counts as busy
USER, WAITING = "user", "waiting"


@dataclass(frozen=True)
class Marks:
    """One read of a worker's board (monotonic times; 0.0 means never)."""

    progress: int = 0  # marks (commits, entries) since the training function was entered; 0 outside it
    progress_at: float = 0.0  # time of the last mark (or of attaching, before the first)
    slowest: float = 0.0  # the slowest interval between two marks of one round
    beats: int = 0  # heartbeats so far; 0: the heartbeat has not started
    alive_at: float = 0.0
    user_since: float = 0.0  # main thread seen idle in user code, without progress, since then
    where: str = ""  # the user frame it was last seen in
    commits: int = 0  # commits of this process, every round's
    steps: int = 0  # intervals recorded (commits after a round's first), and ...
    step_total: float = 0.0  # ... their total length: the agent's step time is a ratio of deltas
    device_since: float = 0.0  # the oldest device work not yet completed was queued then; 0.0: none
    replica_posted_at: float = 0.0  # sharded state: the newest commit's copies to peers were posted then
    replica_done_at: float = 0.0  # ... and the last copy posted completed then (< posted: in flight)

    def replica_lag(self, now: float) -> Optional[float]:
        """Seconds the newest commit's copies took to reach its replica holders, or have
        been travelling so far; None for a worker that replicates nothing."""
        if not self.replica_posted_at:
            return None
        if self.replica_done_at >= self.replica_posted_at:
            return self.replica_done_at - self.replica_posted_at
        return now - self.replica_posted_at


class ProgressBoard:
    """The mapped file. ``create`` (agent) sizes it; ``open`` maps it read-write."""

    def __init__(self, path: str, *, writable: bool):
        self.path = path
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            self._map = mmap.mmap(fd, BOARD_SIZE, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        finally:
            os.close(fd)  # the mapping keeps the file

    @staticmethod
    def create(path: str) -> None:
        with open(path, "wb") as f:
            f.write(b"\0" * BOARD_SIZE)

    def close(self) -> None:
        self._map.close()

    # -- the main thread ---------------------------------------------------------
    def mark(self, now: float, *, interval: bool, commit: bool = False) -> None:
        m = self._map
        if interval:
            last = struct.unpack_from("<d", m, _PROGRESS_AT)[0]
            if now - last > struct.unpack_from("<d", m, _SLOWEST)[0]:
                struct.pack_into("<d", m, _SLOWEST, now - last)
        if commit:
            # The three metrics slots are adjacent: one read and one write for all.
            commits, steps, total = _METRICS_SLOTS.unpack_from(m, _COMMITS)
            if interval:
                steps, total = steps + 1, total + now - last
            _METRICS_SLOTS.pack_into(m, _COMMITS, commits + 1, steps, total)
        struct.pack_into("<d", m, _PROGRESS_AT, now)
        struct.pack_into("<Q", m, _PROGRESS, struct.unpack_from("<Q", m, _PROGRESS)[0] + 1)

    def left_training(self) -> None:
        """The training function returned: what the main thread does next (saving
        results, evaluating alone) is no step, and is not judged as one."""
        struct.pack_into("<Q", self._map, _PROGRESS, 0)

    def detach(self) -> None:
        """The worker is shutting down: no heartbeat from now on, and that is no hang."""
        struct.pack_into("<Q", self._map, _BEATS, 0)

    def attached(self, now: float) -> None:
        """The worker starts counting: stalls are measured from now until the first mark."""
        struct.pack_into("<d", self._map, _PROGRESS_AT, now)

    # -- the heartbeat thread -------------------------------------------------------
    def beat(self, now: float, user_since: float, where: str) -> None:
        m = self._map
        struct.pack_into("<d", m, _USER_SINCE, user_since)
        if where:
            text = where.encode(errors="replace")[-_WHERE_MAX:]
            m[_WHERE:_WHERE + len(text)] = text
            struct.pack_into("<Q", m, _WHERE_LEN, len(text))
        struct.pack_into("<d", m, _ALIVE_AT, now)
        struct.pack_into("<Q", m, _BEATS, struct.unpack_from("<Q", m, _BEATS)[0] + 1)

    # -- the device watch thread (GPU workers, elastic/worker/device_watch.py) ----------
    def device_pending(self, since: float) -> None:
        """Device work queued at ``since`` has not completed (0.0: all work completed)."""
        struct.pack_into("<d", self._map, _DEVICE_SINCE, since)

    # -- sharded state: the main thread posts a commit's copies, the replication thread ends them
    def replica_posted(self, now: float) -> None:
        struct.pack_into("<d", self._map, _REPLICA_POSTED, now)

    def replica_done(self, now: float) -> None:
        struct.pack_into("<d", self._map, _REPLICA_DONE, now)

    # -- the agent ----------------------------------------------------------------------
    def read(self) -> Marks:
        m = self._map
        (progress, progress_at, slowest, beats, alive_at, user_since, commits, steps, step_total, length, device,
         posted, done) = struct.unpack_from("<QddQddQQdQddd", m, 0)
        length = min(length, _WHERE_MAX)
        return Marks(progress, progress_at, slowest, beats, alive_at, user_since,
                     m[_WHERE:_WHERE + length].decode(errors="replace"), commits, steps, step_total, device,
                     posted, done)


@dataclass(frozen=True)
class Frame:
    module: str  # the frame's ``__name__``
    filename: str
    lineno: int
    function: str


def stdlib_prefixes() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple({paths["stdlib"], paths["platstdlib"]})


def classify(frames: Sequence[Frame], stdlib: Iterable[str] = (),
             waiting: Sequence[str] = WAITING_MODULES) -> tuple[str, str]:
    """Where is the main thread? ``frames`` innermost first.

    The innermost frame outside the standard library decides (``Event.wait``
    called from a training script is the script waiting): in a module of
    ``waiting`` (default ``WAITING_MODULES``) it is WAITING on peers, anywhere else
    it is in USER code.
    Returns the verdict and the deciding frame as "file:line in function".
    """
    stdlib = tuple(stdlib)
    for frame in frames:
        name = frame.filename
        library = "site-packages" in name or "dist-packages" in name
        if name.startswith("<frozen") or (not library and any(name.startswith(p) for p in stdlib)):
            continue
        where = f"{frame.filename}:{frame.lineno} in {frame.function}"
        module = frame.module or ""
        if any(module == m or module.startswith(m + ".") for m in PASS_THROUGH_MODULES):
            continue
        if any(module == m or module.startswith(m + ".") for m in waiting):
            return WAITING, where
        return USER, where
    return WAITING, ""  # only interpreter frames: starting up or shutting down


# CPython 3.11 (python/cpython#106883, not fixed in 3.11): sys._current_frames() holds
# the runtime's lock on the list of threads while it makes frame objects. A garbage
# collection that such an allocation triggers may run a finalizer, whose Python code can
# hand the GIL to a thread that is starting another thread: that one then waits for the
# lock while holding the GIL, and the whole process stops for good. Seen in CI: a worker
# froze at start-up, its heartbeat silent after one beat, every thread asleep; reproduced
# with a sampler and a thread-starting loop. So no collection may run inside the call.
# From 3.12 on, collections run only between bytecodes, never inside it.
_COLLECTION_INSIDE_CURRENT_FRAMES = sys.version_info[:2] == (3, 11)
_frames_lock = threading.Lock()  # the heartbeat and the wait clock both sample


def _current_frame(ident: int):
    if not _COLLECTION_INSIDE_CURRENT_FRAMES:
        return sys._current_frames().get(ident)
    with _frames_lock:
        # Restores what it found: a script that turned the collector off keeps it off.
        enabled = gc.isenabled()
        gc.disable()
        try:
            return sys._current_frames().get(ident)
        finally:
            if enabled:
                gc.enable()


def main_thread_frames(main_ident: int, limit: int = 64) -> list[Frame]:
    frame = _current_frame(main_ident)
    out = []
    while frame is not None and len(out) < limit:
        code = frame.f_code
        out.append(Frame(frame.f_globals.get("__name__", ""), code.co_filename, frame.f_lineno, code.co_name))
        frame = frame.f_back
    return out


class Heartbeat:
    """Daemon thread: beat every ``interval``, and watch where the main thread is."""

    def __init__(self, board: ProgressBoard, interval: float = HEARTBEAT_INTERVAL,
                 on_beat: Optional[Callable[[], None]] = None):
        self._board = board
        self._interval = interval
        self._on_beat = on_beat  # also called every beat (NcclTrace.poll); must not block
        self._stop = threading.Event()
        self._stdlib = stdlib_prefixes()
        self._main = threading.main_thread().ident
        self._thread = threading.Thread(target=self._run, name="elastic-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        seen_progress = -1
        user_since = 0.0
        clock = time.pthread_getcpuclockid(self._main)
        last_now, last_cpu = time.monotonic(), time.clock_gettime(clock)
        while True:
            now, cpu = time.monotonic(), time.clock_gettime(clock)
            busy = cpu - last_cpu > BUSY_SHARE * (now - last_now)
            last_now, last_cpu = now, cpu
            marks = self._board.read()
            if marks.progress != seen_progress:
                seen_progress, user_since = marks.progress, 0.0
            kind, where = classify(main_thread_frames(self._main), self._stdlib)
            if kind == USER and not busy:
                user_since = user_since or now
            else:
                user_since = 0.0
            self._board.beat(now, user_since, where)
            if self._on_beat is not None:
                try:
                    self._on_beat()
                except Exception:  # noqa: BLE001 - the heartbeat itself must go on
                    pass
            if self._stop.wait(self._interval):
                return


NCCL_TRACE_SUFFIX = ".nccl-trace"


def nccl_trace_path(stacks_path: str) -> str:
    """Where a worker writes its NCCL flight recorder, beside its stack dump (the agent
    waits for it there)."""
    return stacks_path + NCCL_TRACE_SUFFIX


def nccl_flight_recorder(c10d=None) -> Optional[Callable[[], object]]:
    """The call that returns this process's NCCL flight-recorder dump, or None where
    there is none: a torch without NCCL (CPU builds lack the functions), or a process
    that never imported torch (then it has no NCCL group either; this module does not
    import it). JSON where torch has it (2.5 and later: readable, no unpickling), else
    torch's pickle. ``c10d``: the ``torch._C._distributed_c10d`` to ask (tests)."""
    if c10d is None:
        torch = sys.modules.get("torch")
        c10d = getattr(getattr(torch, "_C", None), "_distributed_c10d", None)
    for name in ("_dump_nccl_trace_json", "_dump_nccl_trace"):
        dump = getattr(c10d, name, None)
        if callable(dump):
            return dump
    return None


def write_nccl_trace(path: str, dump: Callable[[], object]) -> Optional[str]:
    """Write ``dump()`` to ``path`` whole or not at all (a temporary file renamed, so
    the agent never reads half of it). If the dump fails, its error is written there
    instead (the agent stops waiting all the same) and returned; None when it worked."""
    try:
        data = dump()
        error = None
    except Exception as exc:  # noqa: BLE001 - a broken recorder must not kill the worker
        error = f"{type(exc).__name__}: {exc}"
        data = json.dumps({"dump_failed": error})
    if isinstance(data, str):
        data = data.encode()
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        with open(temporary, "wb") as f:
            f.write(bytes(data))
        os.replace(temporary, path)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return error


class NcclTrace:
    """Writes the NCCL flight recorder beside the stack dump each time SIGUSR1 made
    faulthandler write to it (``poll``, from the heartbeat thread: cheap, never blocks).

    The dump queries the recorded collectives' CUDA events from a thread whose current
    device is 0, which may make a context there on a worker of another GPU (gpu-3 N7).
    Accepted: the agent asks right before it kills the worker, or while its heartbeat
    is silent (then this runs only if the worker recovers: once, on a rare path)."""

    def __init__(self, stacks, path: str, dump: Callable[[], object]):
        self._fd = stacks.fileno()
        self._path = path
        self._dump = dump
        self._seen = os.fstat(self._fd).st_size
        self._writer: Optional[threading.Thread] = None
        # An empty file says that a trace follows each stack dump: the agent waits for
        # its replacement after the stacks (watchdog.ask_stacks), and for none without it.
        with open(path, "wb"):
            pass

    def poll(self) -> None:
        size = os.fstat(self._fd).st_size
        if size <= self._seen:
            return
        self._seen = size
        if self._writer is not None and self._writer.is_alive():
            return  # the previous dump is still stuck: one at a time
        self._writer = threading.Thread(target=write_nccl_trace, args=(self._path, self._dump),
                                        name="elastic-nccl-trace", daemon=True)
        self._writer.start()

    def wait(self, timeout: float) -> None:
        """Tests: let the dump in flight end."""
        if self._writer is not None:
            self._writer.join(timeout)


class Progress:
    """The worker's side: its board, its heartbeat, its stack-dump file."""

    def __init__(self, board_path: str, stacks_path: Optional[str]):
        self.board = ProgressBoard(board_path, writable=True)
        self.board.attached(time.monotonic())
        self._stacks = None
        if stacks_path:
            # Kept open for the life of the process: faulthandler writes to its fd
            # from the signal handler, without the GIL (so even a main thread stuck
            # in C code holding it gets its stack shown).
            self._stacks = open(stacks_path, "w")
            faulthandler.register(signal.SIGUSR1, file=self._stacks, all_threads=True)
        self.nccl_trace: Optional[NcclTrace] = None
        dump = nccl_flight_recorder() if stacks_path else None
        if dump is not None:
            self.nccl_trace = NcclTrace(self._stacks, nccl_trace_path(stacks_path), dump)
        on_beat = self.nccl_trace.poll if self.nccl_trace is not None else None
        self._heartbeat = Heartbeat(self.board, on_beat=on_beat).start()

    def mark(self, *, interval: bool, commit: bool = False) -> None:
        self.board.mark(time.monotonic(), interval=interval, commit=commit)

    def close(self) -> None:
        self._heartbeat.stop()
        self.board.detach()
        if self._stacks is not None:
            faulthandler.unregister(signal.SIGUSR1)
            self._stacks.close()
        self.board.close()
