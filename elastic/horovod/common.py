"""Horovod's constants on this runtime: reduction ops, build queries, errors,
process sets and gradient compression."""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import basics

# The reduction ops (opaque ints, as Horovod's C library numbers them).
Average = 0
Sum = 1
Adasum = 2
Min = 3
Max = 4
Product = 5

OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}
ADASUM_REFUSED = ("hvd.Adasum is not supported under elastic-run (Horovod has it only in MPI/NCCL builds, "
                  "not in gloo or elastic ones): use op=hvd.Average")


class HorovodInternalError(dist.DistError):
    """A collective failed because the ring broke (a peer died, the network failed).

    A ``torch.distributed.DistError`` (hence a RuntimeError, as Horovod's is), so the
    runtime treats it as a broken ring: ``elastic.run`` restores the last commit and
    re-forms, as ``hvd.elastic.run`` does on Horovod."""


# -- what this "build" has ---------------------------------------------------------
def gloo_enabled() -> bool:
    return True


def gloo_built() -> bool:
    return True


def mpi_enabled() -> bool:
    return False


def mpi_built() -> bool:
    return False


def mpi_threads_supported() -> bool:
    raise ValueError("Horovod MPI is not enabled: elastic-run runs on torch.distributed (gloo or NCCL)")


def nccl_built() -> int:
    """NCCL's version code (e.g. 21805 for 2.18.5) if torch has NCCL, else 0."""
    if not dist.is_nccl_available():
        return 0
    try:
        major, minor, patch = torch.cuda.nccl.version()[:3]
    except Exception:  # no CUDA runtime to ask
        return 0
    return major * 10000 + minor * 100 + patch


def cuda_built() -> bool:
    return bool(torch.backends.cuda.is_built())


def rocm_built() -> bool:
    return torch.version.hip is not None


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


# -- process sets ------------------------------------------------------------------
class ProcessSet:
    """A subset of the ranks. Only the whole world is supported under elastic-run
    (the ring changes at every re-formation; a fixed list of ranks would not)."""

    def __init__(self, ranks):
        raise NotImplementedError("hvd.ProcessSet: process sets other than hvd.global_process_set "
                                  "are not supported under elastic-run")

    def rank(self) -> int:
        return basics.rank()

    def size(self) -> int:
        return basics.size()

    def included(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "ProcessSet(global)"


class _GlobalProcessSet(ProcessSet):
    def __init__(self):
        self.process_set_id = 0


global_process_set = _GlobalProcessSet()


def add_process_set(process_set):
    raise NotImplementedError("hvd.add_process_set: process sets are not supported under elastic-run")


def remove_process_set(process_set):
    raise NotImplementedError("hvd.remove_process_set: process sets are not supported under elastic-run")


def check_process_set(process_set) -> None:
    if process_set is not None and process_set is not global_process_set:
        raise NotImplementedError("process_set: only hvd.global_process_set is supported under elastic-run")


# -- compression -------------------------------------------------------------------
class Compressor:
    """Turns a tensor into what is sent, and back (Horovod's interface)."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Floating tensors travel as float16 and come back in their own dtype."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point:
            return tensor.type(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        if ctx is not None and ctx.is_floating_point and tensor.dtype != ctx:
            return tensor.type(ctx)
        return tensor


class Compression:
    none = NoneCompressor
    fp16 = FP16Compressor


# -- what has no counterpart here -------------------------------------------------
def start_timeline(file_path, mark_cycles=False):
    raise NotImplementedError("hvd.start_timeline: Horovod's timeline is not supported; elastic-run records "
                              "its own (`elastic-run timeline`)")


def stop_timeline():
    raise NotImplementedError("hvd.stop_timeline: Horovod's timeline is not supported; elastic-run records "
                              "its own (`elastic-run timeline`)")


class SyncBatchNorm:
    """Horovod's SyncBatchNorm needs GPU input; use torch.nn.SyncBatchNorm under the NCCL backend."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("hvd.SyncBatchNorm is not supported under elastic-run: "
                                  "use torch.nn.SyncBatchNorm (NCCL backend)")
