"""The GPU run's NCCL checks on one GPU: the stale dump key, the exit join, an abort
during NCCL set-up with a missing peer (gpu review G2, G5(b), F4; section 4 checks 1-3).

Each runs small child processes with the workers' own NCCL settings (``nccl_env`` of
the default backend, non-blocking communicators), so that what passes here is what
the runtime's workers get; a control child with the setting under test turned back
shows that the check can fail.
"""

from __future__ import annotations

import datetime
import textwrap

from elastic.agent.worker_env import nccl_env
from elastic.contract.devices import CPU_AND_CUDA

from .check_base import Context, Outcome, child_env, python_c, run_children


def workers_nccl_env(**extra: str) -> dict:
    """The NCCL variables a worker of the default backend starts with, plus ``extra``."""
    env = nccl_env(CPU_AND_CUDA)
    # Here, not at the top: nccl_abort imports torch, and every check's process imports
    # this module (check.py), whatever it runs.
    from elastic.worker.nccl_abort import nonblocking_env

    nonblocking_env(env)
    env.update(extra)
    return env


_FORM_AND_WAIT = textwrap.dedent("""
    import datetime, os, sys, time, torch, torch.distributed as dist
    port, prefix, wait_s = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    torch.cuda.set_device(0)
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    if len(sys.argv) > 5 and sys.argv[5] == "clear":  # what the runtime does at each round's entry
        from elastic.worker.round_store import clear_dump_signal
        print("cleared", clear_dump_signal(client, 1), flush=True)
    # As the runtime makes a round's group: a prefix per round over the job's one store.
    dist.init_process_group(sys.argv[4], store=dist.PrefixStore("pg/", dist.PrefixStore(prefix, client)),
                            rank=0, world_size=1, device_id=torch.device("cuda", 0))
    x = torch.ones(4, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    print("formed", flush=True)
    time.sleep(wait_s)
    print("alive", flush=True)
    os._exit(0)
""")


def stale_dump_key(ctx: Context) -> Outcome:
    """A job store that holds NCCL's ``exception_dump`` key (left by any earlier timeout)
    must not kill a later worker's first NCCL group (G2)."""
    import torch.distributed as dist

    seeded = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=60))
    seeded.set("exception_dump", (1).to_bytes(4, "little"))  # what broadcastDumpSignal writes
    clean = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    # Its own seeded store: the child clears the key, which must not hide it from the control.
    seeded_cleared = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=60))
    seeded_cleared.set("exception_dump", (1).to_bytes(4, "little"))
    wait_s = "20"  # past TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=5 plus the monitor's 1 s poll
    cases = {
        "seeded": (seeded.port, workers_nccl_env(TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC="5")),
        "clean": (clean.port, workers_nccl_env(TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC="5")),
        "control": (seeded.port, workers_nccl_env(TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC="5",
                                                  TORCH_NCCL_DUMP_ON_TIMEOUT="1")),
        # Dumps turned back on by a user: the round entry's clear_dump_signal must save it.
        "cleared": (seeded_cleared.port, workers_nccl_env(TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC="5",
                                                          TORCH_NCCL_DUMP_ON_TIMEOUT="1")),
    }
    commands = [python_c(_FORM_AND_WAIT, str(port), f"/round/{i + 1}/", wait_s, CPU_AND_CUDA,
                         *(["clear"] if name == "cleared" else []))
                for i, (name, (port, _)) in enumerate(cases.items())]
    children = run_children(commands, [child_env(env) for _, env in cases.values()], ctx.left())
    result = {name: child for name, child in zip(cases, children)}
    figures = {f"{name}_rc": child.rc for name, child in result.items()}
    figures.update({f"{name}_alive": "alive" in child.out for name, child in result.items()})
    figures["dump_on_timeout_in_workers_env"] = cases["seeded"][1].get("TORCH_NCCL_DUMP_ON_TIMEOUT", "unset (1)")
    if not figures["clean_alive"]:
        return Outcome(False, f"a clean group did not survive (rc {result['clean'].rc}): {result['clean'].tail()}",
                       figures)
    control = ("the control with dump-on-timeout died" if result["control"].rc == -6 else
               f"the control survived (rc {result['control'].rc}): torch here does not act on the key")
    if not figures["seeded_alive"]:
        return Outcome(False, f"the workers' env was killed by a stale exception_dump key (rc {result['seeded'].rc}); "
                       f"{control}", figures)
    if not figures["cleared_alive"]:
        return Outcome(False, f"with dumps on, clearing the key at round entry did not save the group "
                       f"(rc {result['cleared'].rc}): {result['cleared'].tail()}; {control}", figures)
    return Outcome(True, f"the workers' env survives a stale exception_dump key, and so do dumps on once the round "
                   f"entry cleared it; {control}", figures)


_EXIT_AFTER_TIMEOUT = textwrap.dedent("""
    import datetime, time, torch, torch.distributed as dist
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=2), device_id=torch.device("cuda", 0))
    x = torch.ones(4, device="cuda")
    torch.cuda._sleep(int(4 * 2e9))  # >= 4 s on the device: the all-reduce below times out (2 s)
    dist.all_reduce(x)
    time.sleep(8)
    print("alive", time.time(), flush=True)
    # returns normally: the interpreter's exit runs the process group's destructor
""")


def exit_join(ctx: Context) -> Outcome:
    """A worker whose group saw a timeout exits promptly when it returns (G2: the destructor
    joins a heartbeat monitor that sleeps TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC after a dump)."""
    cases = {"workers": workers_nccl_env(TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC="15"),
             "control": workers_nccl_env(TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC="15", TORCH_NCCL_DUMP_ON_TIMEOUT="1")}
    children = run_children([python_c(_EXIT_AFTER_TIMEOUT)] * 2, [child_env(e) for e in cases.values()], ctx.left())
    figures = {}
    for name, child in zip(cases, children):
        alive = [float(t) for t in child.lines("alive") if t.replace(".", "", 1).isdigit()]
        figures[f"{name}_rc"] = child.rc
        figures[f"{name}_exit_after_s"] = round(child.ended - alive[0], 2) if alive and child.rc is not None else None
    lag = figures["workers_exit_after_s"]
    if lag is None:
        return Outcome(False, f"the workers' env child did not reach its end (rc {children[0].rc}): "
                       f"{children[0].tail()}", figures)
    return Outcome(lag < 5.0, f"exit {lag:.1f}s after the script's end (control with dump-on-timeout: "
                   f"{figures['control_exit_after_s']}s)", figures)


_ABORT_IN_SETUP = textwrap.dedent("""
    import datetime, sys, threading, time, torch, torch.distributed as dist
    from elastic.worker import ring_abort
    case, t0 = sys.argv[1], time.monotonic()
    def mark(what):
        print(f"at {what} {time.monotonic() - t0:.2f}", flush=True)
    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    before = ring_abort.socket_snapshot()
    # world 2, rank 1 never comes: the communicator's set-up waits for it for ever
    dist.init_process_group("nccl", store=dist.PrefixStore("/round/1/", store), rank=0, world_size=2,
                            timeout=datetime.timedelta(seconds=60), device_id=torch.device("cuda", 0))
    mark("init_returned")
    ring = ring_abort.prepare_ring(before=before, store_port=store.port)
    def abort(delay):
        time.sleep(delay)
        mark("abort_called")
        ring.abort()
        ring.wait_aborted()
        mark("abort_returned")
    if case == "idle":
        abort(0)
        ring_abort.leave_ring(ring, failed=True, round_number=1)
        mark("left")
        print("initialized", dist.is_initialized(), flush=True)
    else:
        aborter = threading.Thread(target=abort, args=(2,), daemon=True)
        aborter.start()
        try:
            x = torch.ones(4, device="cuda")
            dist.all_reduce(x)
            torch.cuda.synchronize()
            mark("all_reduce_returned")
        except Exception as exc:
            mark("all_reduce_raised")
            print("error", type(exc).__name__, str(exc).replace(chr(10), " ")[:200], flush=True)
        aborter.join(120)
""")


def _marks(child) -> dict:
    return {what: float(at) for what, at in (line.split() for line in child.lines("at "))}


def abort_in_setup(ctx: Context) -> Outcome:
    """An abort reaches an NCCL ring whose set-up waits for a missing peer, with nothing
    pending (i) and while the main thread's first collective waits for the set-up (ii):
    both must end before the abort deadline (G5(b), F4)."""
    env = child_env(workers_nccl_env())
    idle, busy = run_children([python_c(_ABORT_IN_SETUP, "idle"), python_c(_ABORT_IN_SETUP, "busy")], [env, env],
                              ctx.left())
    m_idle, m_busy = _marks(idle), _marks(busy)
    figures = {"nonblocking_timeout": env.get("TORCH_NCCL_NONBLOCKING_TIMEOUT", "unset (1800)"),
               "idle": m_idle, "busy": m_busy, "idle_rc": idle.rc, "busy_rc": busy.rc,
               "busy_error": " ".join(busy.lines("error"))}
    if "init_returned" not in m_idle:
        return Outcome(False, f"init_process_group did not return with the peer absent: {idle.tail()}", figures)
    problems = []
    idle_s = m_idle.get("abort_returned", 1e9) - m_idle["abort_called"] if "abort_called" in m_idle else None
    if idle_s is None or idle_s > 5.0 or "initialized False" not in idle.out:
        problems.append(f"(i) the abort of an idle forming ring took {idle_s}s or left a group")
    busy_s = m_busy.get("abort_returned", 1e9) - m_busy["abort_called"] if "abort_called" in m_busy else None
    from elastic.worker.nccl_abort import ABORT_DEADLINE_S as deadline_s
    if busy_s is None or busy_s > deadline_s - 15:
        problems.append(f"(ii) the abort behind a waiting collective took {busy_s}s (deadline {deadline_s:g}s)")
    figures.update(idle_abort_s=idle_s, busy_abort_s=busy_s)
    if problems:
        return Outcome(False, "; ".join(problems), figures)
    return Outcome(True, f"abort in set-up: idle {idle_s:.1f}s, behind a collective {busy_s:.1f}s", figures)
