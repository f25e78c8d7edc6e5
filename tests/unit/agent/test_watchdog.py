"""Hang detection without processes: the verdict as a table, the stack classifier, the board."""

from __future__ import annotations

import time

import pytest

from elastic.contract.progress import USER, WAITING, Frame, Heartbeat, Marks, ProgressBoard, classify
from elastic.agent.watchdog import HangPolicy, judge

NOW = 1000.0
AUTO = HangPolicy()  # floor 5 s (1 s stopped), factor 3, first interval 300 s


def marks(*, progress=10, since_progress=0.1, slowest=0.2, beats=50, silent=0.1, user_for=0.0, where="train.py:9 in f"):
    return Marks(
        progress=progress,
        progress_at=NOW - since_progress,
        slowest=slowest,
        beats=beats,
        alive_at=NOW - silent,
        user_since=NOW - user_for if user_for else 0.0,
        where=where,
    )


# (case, marks, policy, kernel state, expected kind or None for healthy, expected bound)
CASES = [
    ("training normally", marks(), AUTO, "", None, 0),
    ("heartbeat not started yet", marks(beats=0, silent=900, since_progress=900), AUTO, "T", None, 0),
    ("SIGSTOP: heartbeat silent past the stopped floor", marks(silent=1.1, since_progress=1.2), AUTO, "T", "frozen",
     1.0),
    ("SIGSTOP, silent just under the stopped floor", marks(silent=0.9, since_progress=0.9), AUTO, "T", None, 0),
    ("traced stop (a debugger, py-spy dump): not yet", marks(silent=4.9, since_progress=4.9), AUTO, "t", None, 0),
    ("traced stop past the full floor", marks(silent=5.5, since_progress=5.6), AUTO, "t", "frozen", 5.0),
    ("uninterruptible wait for seconds (a slow disk): not yet", marks(silent=4.9, since_progress=4.9), AUTO, "D",
     None, 0),
    ("uninterruptible wait (hung driver, NFS)", marks(silent=5.5, since_progress=5.6), AUTO, "D", "frozen", 5.0),
    ("state unknown counts as frozen", marks(silent=5.5, since_progress=5.6), AUTO, "", "frozen", 5.0),
    ("state unknown, silent under the floor", marks(silent=4.9, since_progress=4.9), AUTO, "", None, 0),
    ("GIL held by a sleeping thread, past the stopped floor only", marks(silent=3, since_progress=3), AUTO, "S",
     None, 0),
    ("a 10 s step: a stop is judged by 3x it, not the floor", marks(silent=20, since_progress=20, slowest=10), AUTO,
     "T", None, 0),
    ("slow commits scale the freeze bound", marks(silent=20, since_progress=20, slowest=10), AUTO, "T", None, 0),
    ("... up to 3x the slowest interval", marks(silent=31, since_progress=31, slowest=10), AUTO, "T", "frozen", 30.0),
    ("GIL held by a running thread: computing, not hung", marks(silent=600, since_progress=600, slowest=1), AUTO, "R",
     None, 0),
    ("GIL held, every thread asleep: a deadlock", marks(silent=8, since_progress=8, slowest=2), AUTO, "S", "gil-held",
     6.0),
    ("... judged with the first-interval bound before any interval",
     marks(silent=200, since_progress=200, slowest=0), AUTO, "S", None, 0),
    ("main thread in user code, no progress past the floor",
     marks(since_progress=6, user_for=5.8), AUTO, "", "stuck", 5.0),
    ("main thread in user code, progress since", marks(since_progress=1, user_for=8), AUTO, "", None, 0),
    ("victim: main thread waiting in a collective", marks(since_progress=500, user_for=0), AUTO, "", None, 0),
    ("an honest 30 s step, intervals of 30 s seen", marks(since_progress=40, user_for=40, slowest=30), AUTO, "", None, 0),
    ("... still stuck after 3x that", marks(since_progress=95, user_for=95, slowest=30), AUTO, "", "stuck", 90.0),
    ("first 30 s step, no interval seen yet", marks(since_progress=35, user_for=35, slowest=0), AUTO, "", None, 0),
    ("outside the training function (set-up, after it returned): not judged",
     marks(progress=0, since_progress=400, user_for=400, slowest=0), AUTO, "", None, 0),
    ("--hang-timeout fixes the bound", marks(since_progress=21, user_for=21, slowest=30), HangPolicy(timeout=20), "",
     "stuck", 20.0),
    ("--hang-timeout also for freezes", marks(silent=2.5, since_progress=3, slowest=30), HangPolicy(timeout=2), "T",
     "frozen", 2.0),
    ("--hang-timeout 0: off", marks(silent=500, since_progress=500), HangPolicy(timeout=0), "T", None, 0),
]


@pytest.mark.parametrize("case,m,policy,state,kind,bound", CASES, ids=[c[0] for c in CASES])
def test_verdict(case, m, policy, state, kind, bound):
    verdict = judge(m, policy, NOW, state)
    assert verdict.hung == (kind is not None), verdict
    if kind is not None:
        assert verdict.kind == kind
        assert verdict.timeout_s == pytest.approx(bound)
        assert verdict.stalled_s == pytest.approx(NOW - m.progress_at)


def test_a_frozen_verdict_says_where_the_main_thread_was_last_seen():
    verdict = judge(marks(silent=6, since_progress=6, where="train.py:40 in step"), AUTO, NOW, "T")
    assert "no heartbeat for 6.0s (state T)" in verdict.where
    assert "train.py:40 in step" in verdict.where


STDLIB = ("/usr/lib/python3.11",)


def frames(*specs):
    return [Frame(module, filename, 1, "f") for module, filename in specs]


@pytest.mark.parametrize(
    "stack,expected",
    [
        # time.sleep / lock.acquire are C calls: the script's own frame is innermost.
        (frames(("__main__", "/job/train.py")), USER),
        # Event.wait from the script: threading.py is skipped, the script decides.
        (frames(("threading", "/usr/lib/python3.11/threading.py"), ("__main__", "/job/train.py")), USER),
        (frames(("torch.distributed.distributed_c10d", "/venv/site-packages/torch/distributed/distributed_c10d.py"),
                ("__main__", "/job/train.py")), WAITING),
        # DDP's all-reduce waits at the end of backward, in the autograd engine.
        (frames(("torch.autograd.graph", "/venv/site-packages/torch/autograd/graph.py"),
                ("torch._tensor", "/venv/site-packages/torch/_tensor.py"), ("__main__", "/job/train.py")), WAITING),
        (frames(("torch.nn.parallel.distributed", "/venv/site-packages/torch/nn/parallel/distributed.py")), WAITING),
        # The runtime waiting for a round (inside threading.Condition.wait).
        (frames(("threading", "/usr/lib/python3.11/threading.py"),
                ("elastic.rendezvous.control", "/repo/rendezvous/control.py"), ("elastic.worker.runtime", "/repo/elastic/runtime.py")),
         WAITING),
        # A DataLoader waiting on its worker processes (it supervises them itself).
        (frames(("queue", "/usr/lib/python3.11/queue.py"),
                ("torch.utils.data.dataloader", "/venv/site-packages/torch/utils/data/dataloader.py")), WAITING),
        # A user package whose name merely starts like ours.
        (frames(("elastic_tools.io", "/job/elastic_tools/io.py")), USER),
        # A library installed under the stdlib tree is a library, not the stdlib.
        (frames(("mylib", "/usr/lib/python3.11/site-packages/mylib.py")), USER),
        (frames(("importlib._bootstrap", "<frozen importlib._bootstrap>")), WAITING),
        ([], WAITING),
    ],
)
def test_classify_the_main_thread(stack, expected):
    kind, where = classify(stack, STDLIB)
    assert kind == expected
    if stack and expected == USER:
        assert where.endswith(":1 in f")


def test_board_round_trip_and_intervals(tmp_path):
    path = str(tmp_path / "w.progress")
    ProgressBoard.create(path)
    writer, reader = ProgressBoard(path, writable=True), ProgressBoard(path, writable=False)
    try:
        writer.attached(100.0)
        writer.mark(101.0, interval=False)  # entering the training function
        writer.mark(103.0, interval=False)  # a round's first commit: no interval
        writer.mark(103.5, interval=True)
        writer.mark(104.5, interval=True)
        writer.mark(104.7, interval=True)
        writer.beat(104.8, 104.6, "x" * 1000)
        m = reader.read()
        assert (m.progress, m.progress_at, m.slowest) == (5, 104.7, 1.0)
        assert (m.beats, m.alive_at, m.user_since) == (1, 104.8, 104.6)
        assert m.where and set(m.where) == {"x"}  # truncated to fit, never spills
        writer.detach()
        assert judge(reader.read(), AUTO, 10_000.0, "T").hung is False
    finally:
        writer.close()
        reader.close()


def test_heartbeat_sees_the_main_thread_in_user_code_and_waiting(tmp_path):
    """The real thread against this test's own main thread (the only one it can watch)."""
    path = str(tmp_path / "w.progress")
    ProgressBoard.create(path)
    board, reader = ProgressBoard(path, writable=True), ProgressBoard(path, writable=False)
    board.attached(time.monotonic())
    board.mark(time.monotonic(), interval=False)
    heartbeat = Heartbeat(board, interval=0.02).start()
    try:
        deadline = time.monotonic() + 10
        while not reader.read().user_since and time.monotonic() < deadline:
            time.sleep(0.01)  # this frame is user code (a test module)
        m = reader.read()
        assert m.beats > 0 and m.user_since > 0
        assert "test_watchdog.py" in m.where
        board.mark(time.monotonic(), interval=True)  # progress ends the stretch; a new one starts
        deadline = time.monotonic() + 10
        while reader.read().user_since == m.user_since and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reader.read().user_since != m.user_since
    finally:
        heartbeat.stop()
        board.close()
        reader.close()


@pytest.mark.parametrize("text,value", [("off", 0.0), ("OFF", 0.0), ("0", 0.0), ("1", 1.0), ("42.5", 42.5)])
def test_hang_timeout_option(tmp_path, text, value):
    from elastic.cli.launch import parse

    script = tmp_path / "x.py"
    script.write_text("")
    config, _ = parse(["--np", "1", "--backend", "gloo", "--hang-timeout", text, str(script)])
    assert config.hang_timeout == value
    config, _ = parse(["--np", "1", "--backend", "gloo", str(script)])
    assert config.hang_timeout is None  # derived from the job's own commit intervals


@pytest.mark.parametrize("text", ["0.5", "-3", "soon"])
def test_hang_timeout_option_rejects_bad_values(tmp_path, text):
    from elastic.cli.launch import parse
    from elastic.rendezvous import ConfigError

    script = tmp_path / "x.py"
    script.write_text("")
    with pytest.raises(ConfigError, match="--hang-timeout"):
        parse(["--np", "1", "--backend", "gloo", "--hang-timeout", text, str(script)])


def test_a_main_thread_retrying_an_etcd_call_for_the_runtime_is_waiting_not_stuck():
    # Re-forming through an etcd outage: tenacity and grpc frames under rendezvous.etcd.
    from elastic.contract.progress import WAITING, Frame, classify

    frames = [
        Frame("grpc._channel", "/venv/site-packages/grpc/_channel.py", 1, "_blocking"),
        Frame("tenacity", "/venv/site-packages/tenacity/__init__.py", 560, "__call__"),
        Frame("elastic.rendezvous.etcd", "/repo/rendezvous/etcd.py", 310, "_call"),
        Frame("elastic.worker.runtime", "/repo/elastic/runtime.py", 420, "__call__"),
    ]
    assert classify(frames)[0] == WAITING


def test_after_the_agent_itself_was_paused_its_workers_get_a_whole_bound_to_show_life(monkeypatch, tmp_path):
    """A whole host paused (a VM, SIGSTOP of the agent and its workers) and resumed: the
    agent's first looks see every heartbeat as old as the pause, before the workers'
    heartbeat threads (every 0.25 s) have run again. Silence the agent could not watch
    is no evidence: a worker is hung only if it stays silent a whole bound after that."""
    from types import SimpleNamespace

    from elastic.agent import watchdog as wd

    clock = [100.0]
    board = SimpleNamespace(read=lambda: Marks(progress=10, progress_at=99.9, slowest=0.2, beats=50, alive_at=99.95),
                            close=lambda: None)
    dog = wd.Watchdog(AUTO, str(tmp_path), events=None, log_dir=None, clock=lambda: clock[0])
    dog._boards["m.w0"] = board
    monkeypatch.setattr(wd, "_proc_state", lambda pid: "S")  # resumed, its main thread waits
    monkeypatch.setattr(dog, "_evict", lambda hung, plan: None)
    workers = {"m.w0": SimpleNamespace(pid=12345, alive=True)}
    assert dog.check(workers, None) == []
    resumed = clock[0] = 112.0  # agent and worker were stopped for 12 s
    verdicts = {}
    while clock[0] < resumed + 6.0:  # the agent's loop looks every 0.5 s at most
        verdicts[round(clock[0] - resumed, 2)] = dog.check(workers, None)
        clock[0] += 0.05 if clock[0] == resumed else 0.5
    hung_after = [t for t, hung in verdicts.items() if hung]
    # Not at the first looks after the resume; a worker still silent a bound later is hung.
    assert hung_after and min(hung_after) > 5.0, verdicts


def test_a_silent_heartbeat_with_every_thread_asleep_shows_the_stacks_once_before_any_verdict(monkeypatch, tmp_path):
    """Before any step interval was seen, a worker keeping the GIL while it sleeps is given
    the patient bound; its stacks are shown at once, and only once, without a kill."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from elastic.agent import watchdog as wd
    from tests.fakes.waiting import readline_within

    child = subprocess.Popen([sys.executable, "-c", (
        "import faulthandler, signal, sys, threading\n"
        "f = open(sys.argv[1], 'w'); faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)\n"
        "def set_up_of_a_library():\n    print('ready', flush=True); threading.Event().wait(60)\n"
        "set_up_of_a_library()\n"), str(tmp_path / "m.w0.stacks")], stdout=subprocess.PIPE, text=True)
    try:
        assert readline_within(child.stdout, 30).strip() == "ready"
        emitted = []
        events = SimpleNamespace(emit=lambda kind, **fields: emitted.append((kind, fields)))
        (tmp_path / "logs").mkdir()
        dog = wd.Watchdog(AUTO, str(tmp_path), events=events, log_dir=str(tmp_path / "logs"), clock=lambda: NOW)
        dog._boards["m.w0"] = SimpleNamespace(read=lambda: marks(progress=0, silent=6, since_progress=6, slowest=0),
                                              close=lambda: None)
        monkeypatch.setattr(wd, "_proc_state", lambda pid: "S")
        killed = []
        workers = {"m.w0": SimpleNamespace(pid=child.pid, alive=True, signal=killed.append)}
        assert dog.check(workers, None) == [] and dog.check(workers, None) == []
        assert [kind for kind, _ in emitted] == ["hang_suspected"] and not killed
        log = (tmp_path / "logs" / "worker-m.w0.log").read_text()
        assert log.startswith("--- stacks of worker m.w0 (rank None), heartbeat silent 6.0s ---")
        assert "set_up_of_a_library" in log
    finally:
        child.kill()
        child.wait(10)


def _collections_inside_current_frames(seconds: float = 1.0) -> int:
    """Sample the main thread from a helper thread, as the heartbeat does, while the main
    thread keeps entering fresh frames (each sample then makes a frame object inside
    sys._current_frames) and a collection is due at every allocation: how many
    collections started inside that call?"""
    import gc
    import sys
    import threading

    from elastic.contract import progress

    import linecache

    inside = []

    def on_collection(phase, _info):
        # Inside the C call, the innermost Python frame is the line that calls it.
        frame = sys._getframe(1)
        if phase == "start" and frame.f_code.co_name == "_current_frame" and \
                "sys._current_frames()" in linecache.getline(frame.f_code.co_filename, frame.f_lineno):
            inside.append(frame.f_lineno)

    stop = threading.Event()

    def sampler():
        while not stop.is_set():
            progress.main_thread_frames(threading.main_thread().ident)

    def fresh_frame(depth):
        return depth if depth == 0 else fresh_frame(depth - 1)

    threshold = gc.get_threshold()
    gc.callbacks.append(on_collection)
    gc.set_threshold(1)
    thread = threading.Thread(target=sampler, daemon=True)
    try:
        thread.start()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            fresh_frame(20)
    finally:
        stop.set()
        thread.join(10)
        gc.set_threshold(*threshold)
        gc.callbacks.remove(on_collection)
    return len(inside)


def test_no_garbage_collection_starts_inside_sys_current_frames():
    """CPython 3.11 deadlocks when one does (python/cpython#106883; elastic/contract/progress.py)."""
    assert _collections_inside_current_frames() == 0


@pytest.mark.skipif(__import__("sys").version_info[:2] != (3, 11), reason="only CPython 3.11 collects inside the call")
def test_without_the_guard_collections_do_start_inside_sys_current_frames(monkeypatch):
    """The test above can fail: unguarded, collections start inside the call on 3.11."""
    from elastic.contract import progress

    monkeypatch.setattr(progress, "_COLLECTION_INSIDE_CURRENT_FRAMES", False)
    assert _collections_inside_current_frames() > 0
