"""Page-locking a snapshot's host buffers without leaving a CUDA error behind when the driver refuses.

``cudaHostRegister`` pins a buffer at exactly its size (the caching host allocator rounds
up to a power of two). When the driver refuses (memory already registered: error 712;
hosts that do not allow it: confidential computing, some virtual GPUs), the CUDA runtime
keeps the failure as the calling thread's "last error", and torch's check after its next
kernel launch (``cudaGetLastError``) raises it there, at an unrelated call: a
``torch.AcceleratorError`` that the recovery path counts as a broken process. The
replacement then meets the same refusal at its first commit, and so on until
``--max-restarts`` (gpu review gpu-3 N3; sglang#38832 reports the same symptom).

So ``register`` clears the last error at once after a refusal, through the
``cudaGetLastError`` of the CUDA runtime library this process has loaded (torch's
binding has none); where that library cannot be found (a static runtime), through a
one-element kernel whose launch check reads and clears it. After one refusal the
process stops asking: the caller falls back to ``pin_memory()``.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Callable, Optional

log = logging.getLogger(__name__)

_refused: Optional[str] = None  # why the driver refused a registration in this process, once it did
_lock = threading.Lock()


def refused() -> Optional[str]:
    """Why registration is no longer tried in this process (None: it is)."""
    return _refused


def _loaded_cudart_paths(maps: str = "/proc/self/maps") -> list[str]:
    """The CUDA runtime libraries mapped into this process (torch's), by path."""
    try:
        with open(maps) as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    except OSError:
        return []
    return sorted(p for p in paths if p.startswith("/"))


def loaded_cudart(paths: Optional[list[str]] = None, load: Callable[[str], object] = ctypes.CDLL):
    """The CUDA runtime library torch loaded, opened again (the same handle and state), or None."""
    for path in _loaded_cudart_paths() if paths is None else paths:
        try:
            return load(path)
        except OSError:
            continue
    return None


def clear_last_error_with_library(paths: Optional[list[str]] = None,
                                  load: Callable[[str], object] = ctypes.CDLL) -> Optional[int]:
    """Call ``cudaGetLastError`` of the loaded CUDA runtime (the same library, so the same
    per-thread state); the error it cleared, or None if no library could be called."""
    for path in _loaded_cudart_paths() if paths is None else paths:
        try:
            library = load(path)
            return int(library.cudaGetLastError())
        except (OSError, AttributeError):
            continue
    return None


def clear_last_error_with_kernel() -> Optional[str]:
    """Launch a one-element kernel: torch's launch check reads (and so clears) the last
    error and raises it; the error it raised, or None. A second launch must pass: if it
    raises too, the error is sticky (a broken context) and is raised to the caller."""
    import torch

    probe = torch.empty(1, device="cuda")
    try:
        probe.fill_(0)
        return None
    except RuntimeError as exc:  # torch.AcceleratorError is a RuntimeError
        probe.fill_(0)
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"


def register(buffer, *, cudart=None, clear_with_library: Callable[[], Optional[int]] = clear_last_error_with_library,
             clear_with_kernel: Callable[[], Optional[str]] = clear_last_error_with_kernel) -> bool:
    """Page-lock ``buffer`` (a host tensor) with ``cudaHostRegister``; True if it is. On a
    refusal the thread's last CUDA error is cleared before returning False, and later
    calls return False at once (the caller pins another way)."""
    global _refused
    if _refused is not None:
        return False
    if cudart is None:
        import torch

        cudart = torch.cuda.cudart()
    if not hasattr(cudart, "cudaHostRegister"):
        return False
    # flag 0: cudaHostRegisterDefault (the device maps it; copies run async)
    status = int(cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel() * buffer.element_size(), 0))
    if status == 0:
        return True
    cleared = clear_with_library()
    how = "cudaGetLastError" if cleared is not None else f"a probe kernel ({clear_with_kernel()})"
    with _lock:
        if _refused is None:
            _refused = f"cudaHostRegister returned {status}"
            log.warning("host memory registration refused (cudaHostRegister returned %d); CUDA's last error cleared "
                        "through %s; snapshots use pinned allocations from now on", status, how)
    return False


def forget_refusal() -> None:
    """Tests: try registering again."""
    global _refused
    _refused = None
