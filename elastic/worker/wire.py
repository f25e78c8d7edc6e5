"""Plain data between workers: what a peer sends is parsed, bounded and checked, never unpickled.

A peer of the ring is whoever the job's plan names, and the plan is whatever was
written under the job's etcd prefix: a value a peer sends must not be able to run
code in the receiver (pickle can: ``__reduce__``) nor make it allocate what it likes.
So values travel as JSON of a closed set of kinds, every container tagged so that
it comes back as the same type:

    None, bool, int, float, str     themselves (floats keep NaN and infinities)
    ["b", base64]                   bytes
    ["l", [...]] / ["t", [...]]     a list / a tuple
    ["d", [[k, v], ...]]            a dict (keys of any atom kind, in order)
    ["o", [[k, v], ...], meta]      an OrderedDict and its ``_metadata`` (state_dict versions)
    ["T", dtype, shape, base64, kind]  a tensor, "cpu" or "cuda" (only where the caller allows them)

``loads`` refuses anything else, nesting deeper than ``MAX_DEPTH`` and messages over
the caller's bound, with ``PeerDataInvalid``: a ring failure, never the user's. So does
anything else that fails while decoding (security review 2, M4: a dimension of 2^63 in
an empty tensor, a quantized or sub-byte dtype made torch raise, which counted as the
user's error and failed the job): tensors of the dtypes in ``DTYPES`` only, dimensions
below ``MAX_DIMENSION``, "cuda" tensors only where this host has CUDA. Parsed JSON takes
up to about 20 times its bytes in memory (a list of small numbers), so a bound on a
message's bytes bounds what its receiver holds.

No numpy: torch does not require it, so a plain install has none (review 2, M7).
The transport helpers send a message as its length (one int64) and then its bytes,
and check the length against the bound before they allocate anything.
"""

from __future__ import annotations

import base64
import binascii
import ctypes
import datetime
import json
from collections import OrderedDict
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from ..contract.errors import PeerDataInvalid

MAX_DEPTH = 64  # containers within containers; a state tree is a few levels deep
MAX_DIMENSION = 1 << 62  # torch's sizes are int64: beyond, an empty tensor's shape overflows
_ATOMS = (type(None), bool, int, float, str)
_ATOM_SET = frozenset(_ATOMS)
# The dtypes a state may hold, by their printed name ("torch.float32"): an allowlist. Left
# out: quantized (qint8, quint8, ...) and sub-byte (uint1-7, int1-7, bits*, float4) dtypes,
# whose bytes cannot be viewed and cloned as a tensor's.
_DTYPE_NAMES = ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
                "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
                "float8_e5m2", "float8_e4m3fn", "float8_e5m2fnuz", "float8_e4m3fnuz", "float8_e8m0fnu")
DTYPES: dict[str, torch.dtype] = {str(getattr(torch, n)): getattr(torch, n) for n in _DTYPE_NAMES if hasattr(torch, n)}


def dtype_named(name: Any, what: str) -> torch.dtype:
    if not isinstance(name, str) or name not in DTYPES:
        raise PeerDataInvalid(f"{what}: unknown dtype {str(name)[:40]!r}")
    return DTYPES[name]


def device_kind(kind: Any, what: str) -> str:
    """"cpu", or "cuda" where this host has CUDA; PeerDataInvalid else."""
    if kind == "cpu" or (kind == "cuda" and torch.cuda.is_available()):
        return kind
    raise PeerDataInvalid(f"{what}: tensors of device kind {str(kind)[:20]!r} cannot be held here")


def host_bytes(tensor: torch.Tensor) -> bytes:
    """The bytes of ``tensor``, copied to the host, without numpy."""
    host = tensor.detach().to("cpu").contiguous()
    size = host.numel() * host.element_size()
    return ctypes.string_at(host.data_ptr(), size) if size else b""


def to_plain(value: Any, *, tensors: bool = False, depth: int = 0) -> Any:
    """``value`` as JSON-able data (see the module docstring); ValueError for other kinds."""
    if depth > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH}")
    kind = type(value)
    if kind in _ATOMS:
        return value
    if kind is bytes:
        return ["b", base64.b64encode(value).decode("ascii")]
    if kind is list or kind is tuple:
        if set(map(type, value)) <= _ATOM_SET:  # a sampler's million indices: no walk per element
            return ["l" if kind is list else "t", list(value)]
        return ["l" if kind is list else "t", [to_plain(v, tensors=tensors, depth=depth + 1) for v in value]]
    if kind is dict or kind is OrderedDict:
        items = [[to_plain(k, depth=depth + 1), to_plain(v, tensors=tensors, depth=depth + 1)] for k, v in value.items()]
        if kind is dict:
            return ["d", items]
        return ["o", items, to_plain(getattr(value, "_metadata", None), depth=depth + 1)]
    if tensors and isinstance(value, torch.Tensor):
        host = value.detach().to("cpu").contiguous()
        data = host_bytes(host)
        kind = "cuda" if value.is_cuda else "cpu"
        return ["T", str(host.dtype), list(host.shape), base64.b64encode(data).decode("ascii"), kind]
    raise ValueError(f"{kind.__module__}.{kind.__qualname__} cannot travel between workers")


def from_plain(obj: Any, what: str, *, tensors: bool = False, depth: int = 0) -> Any:
    """The value ``to_plain`` made of it; PeerDataInvalid (naming ``what``) for anything else."""
    if depth > MAX_DEPTH:
        raise PeerDataInvalid(f"{what}: nested deeper than {MAX_DEPTH}")
    if type(obj) in _ATOMS:
        return obj
    if type(obj) is not list or not obj or not isinstance(obj[0], str):
        raise PeerDataInvalid(f"{what}: unexpected {type(obj).__name__} in the data")
    tag, body = obj[0], obj[1:]
    if tag == "b" and len(body) == 1 and isinstance(body[0], str):
        return _b64(body[0], what)
    if tag in ("l", "t") and len(body) == 1 and type(body[0]) is list:
        items = body[0]
        if not set(map(type, items)) <= _ATOM_SET:
            items = [from_plain(v, what, tensors=tensors, depth=depth + 1) for v in items]
        return items if tag == "l" else tuple(items)
    if (tag == "d" and len(body) == 1) or (tag == "o" and len(body) == 2):
        if type(body[0]) is not list:
            raise PeerDataInvalid(f"{what}: a dict's items must be a list")
        out = {} if tag == "d" else OrderedDict()
        for pair in body[0]:
            if type(pair) is not list or len(pair) != 2:
                raise PeerDataInvalid(f"{what}: a dict item must be a [key, value] pair")
            key = from_plain(pair[0], what, depth=depth + 1)
            if type(key) not in _ATOMS and type(key) is not bytes:
                raise PeerDataInvalid(f"{what}: a dict key must be an atom, got {type(key).__name__}")
            out[key] = from_plain(pair[1], what, tensors=tensors, depth=depth + 1)
        if tag == "o":
            meta = from_plain(body[1], what, depth=depth + 1)
            if meta is not None:
                if type(meta) not in (dict, OrderedDict):
                    raise PeerDataInvalid(f"{what}: an OrderedDict's metadata must be a dict")
                out._metadata = meta
        return out
    if tag == "T" and tensors and len(body) == 4 and body[3] in ("cpu", "cuda"):
        device_kind(body[3], what)
        tensor = _tensor(body, what)
        # A CUDA value comes back on this worker's device, as pickle would bring it back.
        return tensor.to(torch.cuda.current_device()) if body[3] == "cuda" and torch.cuda.is_available() else tensor
    raise PeerDataInvalid(f"{what}: unknown or malformed entry {tag[:8]!r}")


def _b64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise PeerDataInvalid(f"{what}: malformed bytes") from None


def _tensor(body: list, what: str) -> torch.Tensor:
    dtype = dtype_named(body[0], what)
    shape = body[1]
    if type(shape) is not list or len(shape) > MAX_DEPTH or \
            any(type(d) is not int or not 0 <= d < MAX_DIMENSION for d in shape):
        raise PeerDataInvalid(f"{what}: a tensor's shape must be a list of sizes")
    data = _b64(body[2], what) if isinstance(body[2], str) else None
    numel = 1
    for d in shape:
        numel *= d
    if data is None or len(data) != numel * dtype.itemsize:
        raise PeerDataInvalid(f"{what}: a tensor of shape {shape[:8]} and {body[0]} needs "
                              f"{numel * dtype.itemsize} bytes of data")
    if not numel:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape).clone()


def dumps(value: Any, *, tensors: bool = False) -> bytes:
    return json.dumps(to_plain(value, tensors=tensors), separators=(",", ":")).encode()


def loads(data: bytes, what: str, *, limit: int, tensors: bool = False) -> Any:
    """Parse what a peer sent (at most ``limit`` bytes); PeerDataInvalid if it is not plain data."""
    if len(data) > limit:
        raise PeerDataInvalid(f"{what}: {len(data)} bytes, more than the {limit} allowed")
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise PeerDataInvalid(f"{what}: not plain data ({type(exc).__name__})") from None
    with decoding(what):
        return from_plain(obj, what, tensors=tensors)


class decoding:
    """``with decoding(what):`` anything but PeerDataInvalid raised inside becomes one: a
    decoder's own slip on a peer's bytes is the peer's fault, never the user's."""

    def __init__(self, what: str):
        self._what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is None or isinstance(exc, PeerDataInvalid) or not isinstance(exc, Exception):
            return False
        raise PeerDataInvalid(f"{self._what}: cannot be decoded ({kind.__name__}: {str(exc)[:120]})") from None


# -- transport: length, then bytes ------------------------------------------------------

def _length(n: int, device) -> torch.Tensor:
    return torch.tensor([n], dtype=torch.int64, device=device)


def _checked_length(value: torch.Tensor, what: str, limit: int) -> int:
    n = int(value.item())
    if not 0 <= n <= limit:
        raise PeerDataInvalid(f"{what}: announced {n} bytes, the bound is {limit}")
    return n


def _body(data: bytes, device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data else \
        torch.empty(0, dtype=torch.uint8, device=device)


def send_bytes(data: bytes, receivers: Sequence[int], device, tag: int) -> None:
    """``data`` to each of ``receivers`` in turn (tags ``tag`` and ``tag + 1``)."""
    size, body = _length(len(data), device), _body(data, device)
    for receiver in receivers:
        dist.send(size, dst=receiver, tag=tag)
        dist.send(body, dst=receiver, tag=tag + 1)


def recv_bytes(src: int, device, tag: int, what: str, limit: int, wait_s: Optional[float] = None) -> bytes:
    """``src``'s bytes; ``wait_s``: how long the first message may take to come, when the
    sender has work to do first (gloo honours a wait's own timeout over the group's)."""
    size = torch.empty(1, dtype=torch.int64, device=device)
    if wait_s is None:
        dist.recv(size, src=src, tag=tag)
    else:
        dist.irecv(size, src=src, tag=tag).wait(datetime.timedelta(seconds=wait_s))
    body = torch.empty(_checked_length(size, what, limit), dtype=torch.uint8, device=device)
    dist.recv(body, src=src, tag=tag + 1)
    return host_bytes(body)


def broadcast_bytes(data: Optional[bytes], src: int, rank: int, device, what: str, limit: int) -> bytes:
    """``src``'s ``data`` on every rank of the group."""
    size = _length(len(data) if rank == src else 0, device)
    dist.broadcast(size, src=src)
    n = _checked_length(size, what, limit)
    body = _body(data, device) if rank == src else torch.empty(n, dtype=torch.uint8, device=device)
    dist.broadcast(body, src=src)
    return host_bytes(body)


def all_gather_bytes(data: bytes, world: int, device, what: str, limit: int) -> list[bytes]:
    """Every rank's ``data``, in rank order (each padded to the longest while it travels)."""
    sizes = [torch.empty(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, _length(len(data), device))
    lengths = [_checked_length(s, f"{what} of rank {r}", limit) for r, s in enumerate(sizes)]
    longest = max(lengths)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    mine[: len(data)] = _body(data, device)
    bodies = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(bodies, mine)
    return [host_bytes(b[:n]) for b, n in zip(bodies, lengths)]
