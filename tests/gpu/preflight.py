"""The GPU run's preflight (at most 40 s): is this environment able to run the checks at all?

Records the versions (Python, torch, CUDA, NCCL, the driver, the GPU, protobuf, grpc),
imports the project and its dependencies (from the GPU bundle's site folder when
``tests/gpu/run.sh`` installed one: ``GPU_BUNDLE_SITE``), starts and stops the etcd
server the project finds, and, with CUDA, two probes in child processes at once:

- **host registration (gpu-3 N3):** register a 64 MB buffer, register it again (the
  driver refuses: 712), then launch a kernel. Without the fix the refusal surfaces there
  as an unrelated error; through ``checkpoint.host_pinning.register`` it must not;
- **two NCCL ranks on one GPU:** two processes with distinct ``NCCL_HOSTID`` (NCCL then
  takes them for two hosts, so its duplicate-GPU check passes) all-reduce over the
  loopback within 15 s. NCCL calls same-device ranks unsupported: a refusal is a
  finding, not a broken environment; the checks that need it are then SKIP and the
  three-agent job runs on the gloo ring with CUDA tensors instead.

The environment is broken (the run stops after this) when an import fails, the project
does not come from the bundle that was installed, etcd does not start, or a GPU is
visible to ``nvidia-smi`` but not to torch.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time

from .check_base import Context, Outcome, child_env, python_c, run_children

IMPORTS = ("elastic", "elastic.rendezvous", "elastic.checkpoint", "elastic.worker.ring_abort",
           "elastic.agent.worker_env", "tenacity", "etcd3", "grpc", "google.protobuf", "prometheus_client",
           "cryptography")
DISTRIBUTIONS = ("protobuf", "grpcio", "tenacity", "python3-etcd3", "cryptography", "numpy", "elastic-run")


def two_rank_env(rank: int, prefix: str = "host") -> dict:
    """NCCL settings that let two ranks share one GPU: distinct host ids, sockets on lo."""
    return {"NCCL_HOSTID": f"{prefix}-{rank}", "NCCL_SHM_DISABLE": "1", "NCCL_P2P_DISABLE": "1",
            "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo", "NCCL_DEBUG": "WARN", "CUDA_VISIBLE_DEVICES": "0"}


_TWO_RANKS = textwrap.dedent("""
    import datetime, sys, time, torch, torch.distributed as dist
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    t0 = time.monotonic()
    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=15))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=15),
                            device_id=torch.device("cuda", 0))
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    print("sum", x[0].item(), round(time.monotonic() - t0, 2), flush=True)
    dist.destroy_process_group()
""")

_HOST_REGISTER = textwrap.dedent("""
    import json, torch
    from elastic.checkpoint import host_pinning
    x = torch.zeros(16 << 20)  # 64 MB
    cudart = torch.cuda.cudart()
    torch.ones(1, device="cuda")
    found = {"first": int(cudart.cudaHostRegister(x.data_ptr(), x.numel() * 4, 0)),
             "again": int(cudart.cudaHostRegister(x.data_ptr(), x.numel() * 4, 0))}
    try:  # without the fix: the refusal is still CUDA's last error
        (torch.ones(1, device="cuda") + 1).item()
        found["kernel_after_refusal"] = "ok"
    except Exception as exc:
        found["kernel_after_refusal"] = type(exc).__name__ + ": " + str(exc).splitlines()[0][:160]
    found["register_with_fix"] = host_pinning.register(x)  # refused again (already registered): cleared
    found["refused"] = host_pinning.refused()
    try:
        found["kernel_after_fix"] = "ok" if (torch.ones(1, device="cuda") + 1).item() == 2 else "wrong"
    except Exception as exc:
        found["kernel_after_fix"] = type(exc).__name__ + ": " + str(exc).splitlines()[0][:160]
    cudart.cudaHostUnregister(x.data_ptr())
    print("result", json.dumps(found), flush=True)
""")


def versions() -> dict:
    import torch

    found = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
             "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name(0)
        found["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        nccl = torch.cuda.nccl.version()  # a tuple in recent torch, an int in older ones
        found["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    import torch.distributed as dist

    found["shrink_group"] = hasattr(dist, "shrink_group")
    for name in DISTRIBUTIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def nvidia_smi() -> dict:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return {"driver": None, "gpus_seen": 0}
    try:
        done = subprocess.run([smi, "--query-gpu=driver_version,name,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        return {"driver": f"nvidia-smi failed: {exc}", "gpus_seen": 0}
    rows = [r.split(", ") for r in done.stdout.strip().splitlines() if r.strip()]
    return {"driver": rows[0][0] if rows else None, "gpus_seen": len(rows), "smi": done.stdout.strip()[:300]}


def imports() -> tuple[dict, list[str]]:
    """Where each module came from, and what is broken about it."""
    found, broken = {}, []
    for name in IMPORTS:
        try:
            module = importlib.import_module(name)
            found[name] = getattr(module, "__file__", None) or "namespace"
        except Exception as exc:  # noqa: BLE001 - any failure to import is the finding
            found[name] = f"{type(exc).__name__}: {exc}"
            broken.append(f"import {name}: {type(exc).__name__}: {exc}")
    site = os.environ.get("GPU_BUNDLE_SITE")
    if site:
        for name in ("elastic", "elastic.rendezvous", "elastic.checkpoint"):
            where = found.get(name) or ""
            if not where.startswith(site):
                broken.append(f"{name} comes from {where}, not from the bundle's {site}")
    return found, broken


def etcd() -> tuple[dict, list[str]]:
    from elastic.rendezvous.embedded import EmbeddedEtcd, find_etcd_binary
    from elastic.rendezvous.errors import RendezvousError

    try:
        binary = find_etcd_binary()
    except RendezvousError as exc:
        return {"etcd_missing": str(exc)}, [f"no etcd server binary: {exc}"]
    started = time.monotonic()
    try:
        server = EmbeddedEtcd(binary=binary).start()
    except Exception as exc:  # noqa: BLE001
        return {"etcd_binary": binary, "etcd_missing": f"it did not start: {exc}"}, [f"etcd did not start: {exc}"]
    took = time.monotonic() - started
    server.stop()
    return {"etcd_binary": binary, "etcd_missing": None, "etcd_start_s": round(took, 2)}, []


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cuda_probes(ctx: Context) -> dict:
    """The host-registration probe and the two ranks on one GPU, at once."""
    port = _free_port()
    commands = [python_c(_HOST_REGISTER), python_c(_TWO_RANKS, "0", str(port)), python_c(_TWO_RANKS, "1", str(port))]
    envs = [child_env(), child_env(two_rank_env(0, "preflight")), child_env(two_rank_env(1, "preflight"))]
    register, rank0, rank1 = run_children(commands, envs, min(25.0, ctx.left()))
    found = {}
    lines = register.lines("result")
    found["host_register"] = json.loads(lines[0]) if lines else {"rc": register.rc, "error": register.tail()}
    sums = [child.lines("sum") for child in (rank0, rank1)]
    if all(s and s[0].split()[0] == "2.0" for s in sums):
        found["two_ranks_refused"] = None
        found["two_ranks_s"] = max(float(s[0].split()[1]) for s in sums)
    else:
        said = " | ".join(c.tail(200) for c in (rank0, rank1) if c.err.strip()) or "no output"
        found["two_ranks_refused"] = f"rc {rank0.rc}/{rank1.rc}: {said}"[:400]
    return found


def preflight(ctx: Context) -> Outcome:
    started = time.monotonic()
    figures, broken = {}, []
    figures.update(versions())
    figures.update(nvidia_smi())
    figures["imports"], failed = imports()
    broken += failed
    if not failed:
        found, failed = etcd()
        figures.update(found)
        broken += failed
    else:
        figures["etcd_missing"] = "not tried: the imports failed"
    figures["dev_shm_free_gb"] = round(shutil.disk_usage("/dev/shm").free / 1e9, 1) if os.path.isdir("/dev/shm") else None
    figures["cuda"] = bool(figures.get("cuda_available"))
    figures["device_count"] = 0
    if figures["cuda"]:
        import torch

        figures["device_count"] = torch.cuda.device_count()
        if not failed:
            figures.update(cuda_probes(ctx))
    else:
        figures["two_ranks_refused"] = "no CUDA"
        if figures.get("gpus_seen"):
            broken.append(f"nvidia-smi sees {figures['gpus_seen']} GPU(s) but torch {figures['torch']} has no CUDA")
    figures["seconds"] = round(time.monotonic() - started, 1)
    figures["broken"] = broken
    if broken:
        return Outcome(False, "environment broken: " + "; ".join(broken)[:400], figures)
    detail = (f"torch {figures['torch']}, CUDA {figures.get('cuda')}, NCCL {figures.get('nccl', '-')}, "
              f"driver {figures.get('driver') or '-'}, {figures.get('gpu', 'no GPU')}; imports from "
              f"{'the bundle' if os.environ.get('GPU_BUNDLE_SITE') else 'this Python'}; etcd started in "
              f"{figures.get('etcd_start_s')}s")
    if figures["cuda"]:
        refused = figures.get("two_ranks_refused")
        detail += "; two NCCL ranks on one GPU: " + ("yes" if refused is None else f"refused ({refused[:120]})")
        detail += f"; host registration: {figures.get('host_register')}"
    return Outcome(True, detail[:700], figures)
