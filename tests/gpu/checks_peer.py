"""The GPU run's checks with peers: NCCL peer loss on one GPU, three agents losing a worker,
and the device watch beside a CUDA-graph capture (gpu-3 section 3C: P1, P3, P4; G3', N3, N7).

Two NCCL ranks share the one GPU through distinct ``NCCL_HOSTID`` (NCCL then takes them
for two hosts); the preflight probes that NCCL accepts it, and these checks need it,
except the three-agent job, which falls back to the gloo ring with CUDA tensors.
"""

from __future__ import annotations

import json
import textwrap
import uuid
from pathlib import Path

from tests.fakes.jobs import Job, read_jsonl

from .check_base import Context, Outcome, child_env, python_c, run_children
from .checks_nccl import workers_nccl_env
from .preflight import _free_port, two_rank_env

_PEER_LOSS = textwrap.dedent("""
    import datetime, json, os, signal, sys, threading, time, torch, torch.distributed as dist
    from elastic.worker import ring_abort, device_watch
    from elastic.worker.device_health import check_device
    from elastic.worker.failures import classify
    case, rank, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    t0 = time.monotonic()
    def mark(what, **more):
        print("mark", json.dumps({"what": what, "t": round(time.monotonic() - t0, 3), **more}), flush=True)
    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    before = ring_abort.socket_snapshot()
    timeout_s = 3 if case.startswith("timeout") else 60
    dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.PrefixStore("/round/1/", store), rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=torch.device("cuda", 0))
    ring = ring_abort.prepare_ring(before=before, store_port=port)
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    mark("formed")
    big = torch.ones(256 << 20, device="cuda")  # 1 GiB
    if rank == 1:
        if case == "sigkill":
            dist.all_reduce(big)
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(40)  # alive on the host, never in the next collective
        os._exit(0)
    class Board:
        def device_pending(self, since):
            pass
    if case == "timeout_fixed":  # the G3' fix: the device watch aborts a ring that reports an error
        watch = device_watch.DeviceWatch(Board(), poll_s=0.25, device=0, ring_source=lambda: ring)
    samples = []
    def sample():
        while time.monotonic() - t0 < 30:
            samples.append((round(time.monotonic() - t0, 2), ring.error(), ring.aborted))
            time.sleep(0.5)
    threading.Thread(target=sample, daemon=True).start()
    if case == "abort":  # (i) the plan-driven abort, 3 s into a wait on a live peer
        def later():
            time.sleep(3)
            mark("abort_called")
            ring.abort()
            ring.wait_aborted()
            mark("abort_returned")
        threading.Thread(target=later, daemon=True).start()
    elif case == "timeout_unfixed":  # (iii) nothing aborts: at 8 s is the sync still blocked?
        def look():
            time.sleep(8)
            mark("at_8s", error=ring.error(), sync_returned=False)
            ring.abort()
            ring.wait_aborted()
            mark("abort_returned")
        threading.Thread(target=look, daemon=True).start()
    elif case == "sigkill":  # (ii) does NCCL over sockets report the dead peer by itself?
        def later():
            time.sleep(10)
            mark("abort_called", error=ring.error())
            ring.abort()
            ring.wait_aborted()
            mark("abort_returned")
        threading.Thread(target=later, daemon=True).start()
    dist.all_reduce(big if case == "sigkill" else x)
    mark("all_reduce_returned")
    try:
        ring_abort.check_ring(ring, device_sync=True)
        mark("check_ring_passed")
    except ring_abort.RingBroken as exc:
        mark("check_ring_raised", error=str(exc)[:120])
    try:
        dist.all_reduce(x)
        torch.cuda.synchronize()
        mark("next_collective_passed")
    except Exception as exc:
        mark("next_collective_raised", kind=str(classify(exc).kind))
    first = next((s for s in samples if s[1] is not None), None)
    mark("first_error", sample=first)
    ring_abort.leave_ring(ring, failed=True, round_number=1)
    mark("left")
    took = check_device("cpu:gloo,cuda:nccl", 20.0, slot=0)
    mark("device_checked", took=took)
    dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    y = torch.ones(4, device="cuda")
    dist.all_reduce(y)
    torch.cuda.synchronize()
    mark("fresh_init", value=y[0].item())
    os._exit(0)
""")

CASES = ("abort", "sigkill", "timeout_unfixed", "timeout_fixed")


def _marks(child) -> dict:
    found = {}
    for line in child.lines("mark"):
        entry = json.loads(line)
        found[entry.pop("what")] = entry
    return found


def peer_loss_verdict(marks: dict) -> tuple[bool, str]:
    """Each case's expectation from rank 0's marks (tests/unit/gpu: canned marks)."""
    problems, said = [], []
    abort = marks.get("abort", {})
    if "abort_returned" in abort and "check_ring_raised" in abort and "fresh_init" in abort:
        latency = abort["abort_returned"]["t"] - abort["abort_called"]["t"]
        said.append(f"(i) abort {latency:.2f}s, next collective {abort.get('next_collective_raised', {}).get('kind')}")
        if latency > 10:
            problems.append(f"(i) the abort took {latency:.1f}s")
    else:
        problems.append(f"(i) abort on a live peer: marks {sorted(abort)}")
    sigkill = marks.get("sigkill", {})
    first = (sigkill.get("first_error") or {}).get("sample")
    said.append(f"(ii) after a peer's SIGKILL NCCL reported {first[1] + ' at ' + str(first[0]) + 's' if first else 'nothing in 10s'}")
    if "fresh_init" not in sigkill:
        problems.append(f"(ii) peer SIGKILL: no recovery (marks {sorted(sigkill)})")
    unfixed = marks.get("timeout_unfixed", {})
    at8 = unfixed.get("at_8s")
    if at8 is not None:
        blocked = "all_reduce_returned" not in unfixed or unfixed["all_reduce_returned"]["t"] > at8["t"]
        said.append(f"(iii) G3' without the fix: sync {'still blocked' if blocked else 'returned'} at 8s, "
                    f"error {at8.get('error')}")
    fixed = marks.get("timeout_fixed", {})
    if "check_ring_raised" in fixed and "fresh_init" in fixed:
        said.append(f"(iv) with the device watch's abort: RingBroken at {fixed['check_ring_raised']['t'] - fixed['formed']['t']:.1f}s "
                    f"after forming (timeout 3s)")
        if fixed["check_ring_raised"]["t"] - fixed["formed"]["t"] > 20:
            problems.append("(iv) the device watch's abort came later than 20 s")
    else:
        problems.append(f"(iv) G3' fix: the timed-out ring did not end in RingBroken (marks {sorted(fixed)})")
    return not problems, "; ".join(problems + said)


def nccl_peer_loss(ctx: Context) -> Outcome:
    """Two NCCL ranks on one GPU (distinct host ids), four pairs at once: (i) the plan-driven
    abort 3 s into a wait on a live peer, (ii) a peer SIGKILLed mid all-reduce, (iii) a
    collective timeout with nothing to abort it (G3' as it was), (iv) the same with the
    device watch's abort (G3' fixed). Each records the abort's latency, ``check_ring``'s
    RingBroken, the next collective's class, ``leave_ring``, the device check and a fresh init."""
    commands, envs = [], []
    for case in CASES:
        port = _free_port()
        for rank in (0, 1):
            commands.append(python_c(_PEER_LOSS, case, str(rank), str(port)))
            envs.append(child_env({**workers_nccl_env(), **two_rank_env(rank, f"{case}-{uuid.uuid4().hex[:6]}")}))
    children = run_children(commands, envs, ctx.left())
    marks = {case: _marks(children[2 * i]) for i, case in enumerate(CASES)}
    figures = {"marks": marks, "rc": {case: [children[2 * i].rc, children[2 * i + 1].rc] for i, case in enumerate(CASES)},
               "tails": {case: children[2 * i].tail(300) for i, case in enumerate(CASES)}}
    ok, detail = peer_loss_verdict(marks)
    return Outcome(ok, detail[:700], figures)


def _agents(ctx: Context, backend: str, device: str, nccl_hosts: bool, steps: int = 60, kill_at: int = 20,
            step_delay: float = 0.05) -> Outcome:
    from elastic.rendezvous.embedded import EmbeddedEtcd, find_etcd_binary

    server = EmbeddedEtcd(binary=find_etcd_binary()).start()
    job_id = f"gpu-kill-{uuid.uuid4().hex[:8]}"
    agents = []
    try:
        for i, name in enumerate(("a", "b", "c")):
            home = ctx.workdir / name
            home.mkdir()
            env = child_env({"CUBLAS_WORKSPACE_CONFIG": ":4096:8", **(two_rank_env(i, job_id) if nccl_hosts else {})})
            launch = ["--rdzv-endpoint", server.endpoint, "--job-id", job_id, "--host-id", name,
                      "--host-addr", "127.0.0.1", "--nproc-per-node", "1", "--min-np", "2", "--max-np", "3",
                      "--backend", backend, "--max-restarts", "2", "--collective-timeout", "20"]
            script = ["--device", device, "--steps", str(steps), "--step-delay", str(step_delay), "--kill-rank", "1",
                      "--kill-at", f"{kill_at}:after-allreduce"]
            agents.append(Job(home, Job.train_args(home / "out", home / "logs", launch, script), name=name, env=env,
                              cwd=home))
        codes = {}
        for agent in agents:
            try:
                codes[agent.name] = agent.proc.wait(ctx.left(5))
            except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: past the bound
                codes[agent.name] = None
    finally:
        for agent in agents:
            agent.kill()
        server.stop()
    return _agents_verdict(ctx, agents, codes, backend)


def _agents_verdict(ctx: Context, agents, codes: dict, backend: str) -> Outcome:
    import torch

    events = [e for agent in agents for e in _events(agent)]
    reforms = [e for e in events if e["event"] == "reform_done"]
    hangs = [e for e in events if e["event"] == "hang_detected"]
    finals = [(p, torch.load(p, weights_only=True)) for agent in agents for p in sorted(agent.out.glob("final-*.pt"))]
    killed = [p.name for agent in agents for p in agent.out.glob("killed-*")]
    figures = {"backend": backend, "rc": codes, "reforms": len(reforms), "hangs": len(hangs), "finals": len(finals),
               "killed": killed, "reform_total_s": [e.get("total_s") for e in reforms][:6],
               "worlds": sorted({s["world"] for agent in agents for s in _steps(agent)})}
    problems = []
    if any(rc != 0 for rc in codes.values()):
        problems.append(f"exit statuses {codes}: " + " | ".join(a.text()[-200:] for a in agents if codes[a.name] != 0))
    if not killed:
        problems.append("no worker was killed")
    if not any(e.get("failed") for e in reforms):
        problems.append("no in-process re-formation after the kill")
    if hangs:
        problems.append(f"{len(hangs)} hang verdict(s)")
    if len(finals) < 2:
        problems.append(f"{len(finals)} final weights")
    elif any(not torch.equal(v, finals[0][1][k]) for _, f in finals[1:] for k, v in f.items()):
        problems.append("the workers' final weights differ")
    if problems:
        return Outcome(False, "; ".join(problems)[:700], figures)
    return Outcome(True, f"{backend}: a worker killed, {len(reforms)} re-formations "
                   f"(worlds {figures['worlds']}, re-form {figures['reform_total_s'][:3]} s), {len(finals)} equal "
                   f"final weights, no hang verdict", figures)


def _events(agent: Job) -> list:
    try:
        return agent.events()
    except FileNotFoundError:
        return []


def _steps(agent: Job) -> list:
    try:
        return read_jsonl(agent.out / "steps.jsonl")
    except FileNotFoundError:
        return []


def three_agents_kill(ctx: Context) -> Outcome:
    """The product's main claim on NCCL: three agents, one worker each on the one GPU
    (distinct host ids), ``--backend auto``; a worker SIGKILLed after step 20's all-reduce;
    the survivors re-form in-process, the replacement joins, every worker ends with equal
    weights and nobody is judged hung. Where NCCL refused two ranks on one GPU
    (preflight), the same job on the gloo ring with CUDA tensors."""
    if ctx.facts.get("two_ranks_refused") is None:
        return _agents(ctx, "auto", "cuda", nccl_hosts=True)
    outcome = _agents(ctx, "gloo", "cuda", nccl_hosts=False)
    outcome.detail = f"(NCCL refused two ranks on one GPU: gloo with CUDA tensors) {outcome.detail}"
    return outcome


def three_agents_kill_cpu(ctx: Context) -> Outcome:
    """The three-agent job on CPUs and gloo: the harness, the bundle's wheel and the layers
    of ``PYTHONPATH`` through agents and workers, where a CPU CI can run them."""
    return _agents(ctx, "gloo", "cpu", nccl_hosts=False, steps=24, kill_at=8, step_delay=0.02)


_CAPTURE = textwrap.dedent("""
    import json, sys, threading, time, torch
    from elastic.worker import device_watch
    mode = sys.argv[1]
    torch.cuda.set_device(0)
    class Board:
        def device_pending(self, since):
            pass
    prepare = (lambda device: None) if mode == "unprepared" else None
    watch = device_watch.DeviceWatch(Board(), poll_s=0.001, device=0, probe_stream=torch.cuda.default_stream(0),
                                     prepare_thread=prepare)
    a = torch.randn(512, 512, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up, as torch's docs ask before a capture
        for _ in range(3):
            b = a @ a
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    result = {"mode": mode}
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):  # global capture mode, the default
            b = a
            for _ in range(20):
                b = b @ a
                b = b / b.norm()
        g.replay()
        torch.cuda.synchronize()
        result["capture"] = "ok"
    except Exception as exc:
        result["capture"] = type(exc).__name__ + ": " + str(exc).splitlines()[0][:200]
    watch.close()
    result["primary_context_on_0"] = bool(torch._C._cuda_hasPrimaryContext(0))
    print("result", json.dumps(result), flush=True)
""")


def capture_vs_watch(ctx: Context) -> Outcome:
    """N7: a device watch polling every 1 ms beside a global-mode CUDA-graph capture of 20
    matmuls; with the watch thread prepared (its device set, relaxed capture mode) the
    capture and its replay must succeed. The unprepared thread (the code before the fix) is
    recorded beside it, not judged."""
    children = run_children([python_c(_CAPTURE, "prepared"), python_c(_CAPTURE, "unprepared")],
                            [child_env(), child_env()], ctx.left())
    results = {}
    for child in children:
        lines = child.lines("result")
        found = json.loads(lines[0]) if lines else {"capture": f"no result (rc {child.rc}): {child.tail(200)}"}
        results[found.get("mode", f"rc{child.rc}")] = found
    prepared = results.get("prepared", {}).get("capture")
    detail = f"capture beside a 1 ms device watch: prepared thread {prepared}; before the fix " \
             f"{results.get('unprepared', {}).get('capture')}"
    return Outcome(prepared == "ok", detail[:600], {"results": results})


__all__ = ["nccl_peer_loss", "three_agents_kill", "three_agents_kill_cpu", "capture_vs_watch", "peer_loss_verdict",
           "Path"]
