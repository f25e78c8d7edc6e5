"""Which backend a job's process groups use, and what a backend string means.

``--backend auto`` picks a group that handles CPU and CUDA tensors alike
(``cpu:gloo,cuda:nccl``) when this host can give every one of its workers a GPU
of its own, else gloo: a CPU-only script on a GPU host still runs, and a host with
fewer GPUs than workers never gets "invalid device ordinal" or NCCL's "Duplicate
GPU detected". ``--backend nccl`` asks for NCCL alone: refused before anything
starts when it cannot work. The answer is a string for
``torch.distributed.init_process_group``; ``uses_nccl`` reads one back, because a
combined string is never equal to "nccl".
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

BACKENDS = ("auto", "gloo", "nccl")
CPU_AND_CUDA = "cpu:gloo,cuda:nccl"  # gloo for CPU tensors, NCCL for CUDA tensors, in one group


# What a host with a GPU that torch could use has, whichever the driver: NVIDIA's control
# device and driver file, or ROCm's kernel driver (torch.cuda runs on ROCm too).
_GPU_DRIVER_PATHS = ("/dev/nvidiactl", "/proc/driver/nvidia/version", "/dev/kfd")


def may_have_cuda(exists=os.path.exists, environ=None) -> bool:
    """Could torch see a CUDA device here? False only when it certainly cannot: no GPU
    driver is present, or CUDA_VISIBLE_DEVICES hides every device. Asking torch costs
    the 1.4 s of importing it, on every ``elastic-run`` start of a CPU host."""
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return any(exists(path) for path in _GPU_DRIVER_PATHS)


def choose_backend(requested: str, *, cuda_available: bool, device_count: int, nproc_per_node: int) -> str:
    """The backend string for ``init_process_group``; ValueError (one line) when
    ``requested`` cannot work on this host."""
    if requested not in BACKENDS:
        raise ValueError(f"--backend must be auto, gloo or nccl (got {requested!r})")
    if requested == "gloo":
        return "gloo"
    enough = cuda_available and device_count >= nproc_per_node
    if requested == "auto":
        return CPU_AND_CUDA if enough else "gloo"
    if not cuda_available:
        raise ValueError("--backend nccl needs CUDA, and torch sees no CUDA device on this host (use gloo or auto)")
    if not enough:
        raise ValueError(f"--backend nccl runs one worker per GPU: --nproc-per-node {nproc_per_node} but "
                         f"{device_count} GPU(s) visible (CUDA_VISIBLE_DEVICES); use fewer workers, or gloo")
    return "nccl"


def uses_nccl(backend: str) -> bool:
    """Does ``backend`` (``nccl``, ``cpu:gloo,cuda:nccl``, ...) run any of its work on NCCL?"""
    return any(part.split(":")[-1].strip().lower() == "nccl" for part in backend.split(","))


@dataclass(frozen=True)
class Capability:
    """What a backend string lets a job do: where its model lives, and which tensors travel
    over which part of its process group."""

    backend: str
    model_device: str  # "cuda" when CUDA tensors travel over NCCL, else "cpu"
    host_backend: Optional[str]  # the part that carries CPU tensors (None: pure NCCL)
    device_backend: Optional[str]  # the part that carries CUDA tensors

    @property
    def wire_device(self) -> str:
        """Where the runtime's own small tensors (flags, holdings) and staged state
        transfers must be to travel: the host when some part carries CPU tensors (no
        device sync, no GPU memory), else the device."""
        return "cpu" if self.host_backend is not None else "cuda"

    @property
    def nccl(self) -> bool:
        """Does any part of the process group run on NCCL (``uses_nccl`` of the string)?"""
        return "nccl" in (self.host_backend, self.device_backend)

    @property
    def gloo(self) -> bool:
        """Does any part of the process group run on gloo (its TCP mesh is ours to shut)?"""
        return "gloo" in (self.host_backend, self.device_backend)


# torch's defaults for a backend named without devices (distributed_c10d.Backend).
_PLAIN = {"nccl": ("cuda",), "gloo": ("cpu", "cuda"), "mpi": ("cpu", "cuda"), "ucc": ("cpu", "cuda")}


def capability(backend: str) -> Capability:
    """``capability("cpu:gloo,cuda:nccl")``: the model on CUDA, host tensors over gloo,
    CUDA tensors over NCCL. ValueError (one line) for a string torch would refuse."""
    parts: dict[str, str] = {}
    for part in (p.strip().lower() for p in backend.split(",")):
        device, _, name = part.rpartition(":")
        if not name or (not device and name not in _PLAIN) or (device and device not in ("cpu", "cuda")):
            raise ValueError(f"backend {backend!r}: {part!r} is not <backend> or cpu:/cuda:<backend>")
        for dev in (device,) if device else _PLAIN[name]:
            parts.setdefault(dev, name)
    device_backend = parts.get("cuda")
    return Capability(backend, "cuda" if device_backend == "nccl" else "cpu", parts.get("cpu"), device_backend)
