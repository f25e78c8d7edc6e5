"""A snapshot's layout as plain data, checked on arrival: what a receiver of a state sync trusts.

The first holder of the ring's newest commit sends its ``Layout`` (the tree's structure,
where each tensor lies in the flat buffers, the plain values) to every receiver, which
allocates buffers by it and loads the state it then receives. So a layout is checked
as a whole before anything is allocated: known dtypes and device kinds, every tensor
inside its buffer, a tree whose leaves match the tensors and plain values it names,
and buffers that fit in this host's memory. A layout that fails is ``PeerDataInvalid``,
and so is anything else that fails while decoding it (security review 2, M4).

What this does not check: that the values are the job's (a member that sends a well
formed layout of another model is believed; see SECURITY.md: whoever can write the
job's etcd prefix is a member of the job).
"""

from __future__ import annotations

import os
from typing import Any

from elastic.checkpoint.snapshot import Layout, TensorSpec

from ..contract.errors import PeerDataInvalid
from . import wire

_WHAT = "state layout"
_KINDS = ("cpu", "cuda")
_KEYS = (type(None), bool, int, float, str, bytes)  # what a tree's keys and paths are made of
_TAGS = {"T": 1, "P": 1, "D": 3, "O": 4, "L": 2, "U": 2}  # treedef tag -> tuple length


def encode(layout: Layout) -> bytes:
    return wire.dumps({
        "treedef": layout.treedef,
        "tensors": [[s.path, list(s.shape), str(s.dtype), s.kind, s.buffer, s.offset] for s in layout.tensors],
        "buffers": [[str(dtype), kind, numel] for dtype, kind, numel in layout.buffers],
        "plains": list(layout.plains),
    })


def decode(data: bytes, *, limit: int, memory_bytes: int | None = None) -> Layout:
    """The layout ``encode`` made, or PeerDataInvalid saying what is wrong with it."""
    with wire.decoding(_WHAT):
        return _decode(data, limit, memory_bytes)


def _decode(data: bytes, limit: int, memory_bytes: int | None) -> Layout:
    body = wire.loads(data, _WHAT, limit=limit)
    if type(body) is not dict or set(body) != {"treedef", "tensors", "buffers", "plains"}:
        raise PeerDataInvalid(f"{_WHAT}: expected treedef, tensors, buffers and plains")
    buffers = tuple(_buffer(b) for b in _list(body["buffers"], "buffers"))
    total = sum(numel * dtype.itemsize for dtype, _, numel in buffers)
    memory = memory_bytes if memory_bytes is not None else _host_memory()
    if memory and total > memory:
        raise PeerDataInvalid(f"{_WHAT}: {total} bytes of buffers, more than this host's {memory} bytes of memory")
    specs = tuple(_spec(s, buffers) for s in _list(body["tensors"], "tensors"))
    plains = tuple(_list(body["plains"], "plains"))
    counts = {"T": 0, "P": 0}
    _check_tree(body["treedef"], counts, 0)
    if (counts["T"], counts["P"]) != (len(specs), len(plains)):
        raise PeerDataInvalid(f"{_WHAT}: the tree has {counts['T']} tensors and {counts['P']} plain values, "
                              f"the layout {len(specs)} and {len(plains)}")
    return Layout(body["treedef"], specs, buffers, plains)


def _list(value: Any, name: str) -> list:
    if type(value) is not list:
        raise PeerDataInvalid(f"{_WHAT}: {name} must be a list")
    return value


def _count(value: Any, name: str) -> int:
    if type(value) is not int or not 0 <= value < wire.MAX_DIMENSION:
        raise PeerDataInvalid(f"{_WHAT}: {name} must be a count, got {str(value)[:40]!r}")
    return value


def _buffer(entry: Any) -> tuple:
    if type(entry) is not list or len(entry) != 3:
        raise PeerDataInvalid(f"{_WHAT}: a buffer must be [dtype, kind, numel]")
    dtype = wire.dtype_named(entry[0], _WHAT)
    if entry[1] not in _KINDS:
        raise PeerDataInvalid(f"{_WHAT}: unknown device kind {str(entry[1])[:20]!r}")
    wire.device_kind(entry[1], _WHAT)  # "cuda" buffers only where this host has CUDA
    return dtype, entry[1], _count(entry[2], "a buffer's size")


def _spec(entry: Any, buffers: tuple) -> TensorSpec:
    if type(entry) is not list or len(entry) != 6:
        raise PeerDataInvalid(f"{_WHAT}: a tensor must be [path, shape, dtype, kind, buffer, offset]")
    path, shape, dtype_name, kind, buffer, offset = entry
    if type(path) is not tuple or any(type(k) not in _KEYS for k in path):
        raise PeerDataInvalid(f"{_WHAT}: a tensor's path must be a list of keys")
    shape = tuple(_count(d, "a dimension") for d in _list(shape, "a shape"))
    numel = 1
    for d in shape:
        numel *= d
    buffer, offset = _count(buffer, "a buffer index"), _count(offset, "an offset")
    if buffer >= len(buffers):
        raise PeerDataInvalid(f"{_WHAT}: tensor {_name(path)} names buffer {buffer} of {len(buffers)}")
    b_dtype, b_kind, b_numel = buffers[buffer]
    dtype = wire.dtype_named(dtype_name, _WHAT)
    if (dtype, kind) != (b_dtype, b_kind) or offset + numel > b_numel:
        raise PeerDataInvalid(f"{_WHAT}: tensor {_name(path)} does not lie inside its buffer")
    return TensorSpec(tuple(path), shape, dtype, kind, buffer, offset)


def _check_tree(node: Any, counts: dict, depth: int) -> None:
    """Every node of a treedef well formed (see checkpoint/snapshot.py); counts its leaves."""
    if (depth > wire.MAX_DEPTH or type(node) is not tuple or not node or type(node[0]) is not str
            or _TAGS.get(node[0]) != len(node)):
        raise PeerDataInvalid(f"{_WHAT}: malformed tree node {str(node)[:40]}")
    tag = node[0]
    if tag in counts:
        counts[tag] += 1
        return
    children = node[-1] if tag in ("L", "U") else node[2]
    if type(children) is not tuple:
        raise PeerDataInvalid(f"{_WHAT}: a tree node's children must be a tuple")
    if tag in ("D", "O"):
        keys = node[1]
        if (type(keys) is not tuple or len(keys) != len(children) or any(type(k) not in _KEYS for k in keys)
                or len(set(keys)) != len(keys)):
            raise PeerDataInvalid(f"{_WHAT}: a dict node needs one distinct key per child")
        if tag == "O" and node[3] is not None and not isinstance(node[3], dict):
            raise PeerDataInvalid(f"{_WHAT}: an OrderedDict node's metadata must be a dict")
    for child in children:
        _check_tree(child, counts, depth + 1)


def _name(path) -> str:
    return "/".join(str(k) for k in path)[:80] or "<root>"


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
