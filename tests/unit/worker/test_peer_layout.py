"""A state layout from a peer is plain data, checked: a crafted one runs no code and is a ring failure.

Security review, finding 1 (a): rank 0 plays a peer that sends what the old runtime sent
(a pickle whose ``__reduce__`` touches a marker file), then other crafted layouts;
rank 1 is a real receiver (``receive_layout``) in a real gloo ring.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from elastic.checkpoint.snapshot import Snapshot
from elastic.contract.errors import PeerDataInvalid
from elastic.worker import layout_wire, wire
from elastic.worker.failures import RING, classify

_COMMON = """
import datetime, json, os, pathlib, pickle, sys, torch, torch.distributed as dist
from elastic.checkpoint.snapshot import Snapshot
from elastic.worker import layout_wire, state_transfer
rank, store_path, marker = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=30))
snap = Snapshot()
snap.capture({"w": torch.arange(4.0), "epoch": 3})
tag = state_transfer._LAYOUT_TAG

def entries(data):  # a layout's top-level fields, still in their tagged form
    return {key: value for key, value in json.loads(data)[1]}

def packed(fields):
    return json.dumps(["d", [[key, value] for key, value in fields.items()]]).encode()

def send_raw(data, size=None):
    dist.send(torch.tensor([len(data) if size is None else size], dtype=torch.int64), dst=1, tag=tag)
    if size is None:
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=1, tag=tag + 1)
"""

_PEER = _COMMON + """
class Evil:
    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(marker),))

send_raw(pickle.dumps(Evil()))                        # what the old runtime unpickled
outside = entries(layout_wire.encode(snap.layout()))
outside["tensors"][1][0][1][5] = 10 ** 12              # a tensor far outside its buffer
send_raw(packed(outside))
huge = entries(layout_wire.encode(snap.layout()))
huge["buffers"][1][0][1][2] = 10 ** 15                 # a buffer of petabytes
send_raw(packed(huge))
state_transfer.send_layout(snap.layout(), [1], "gloo")  # an honest one still arrives
send_raw(b"", size=10 ** 15)                          # announces more than the bound: nothing follows
print(json.dumps({"sent": True}), flush=True)
"""

_RECEIVER = _COMMON + """
from elastic.worker.failures import classify
results = []
for _ in range(5):
    try:
        layout = state_transfer.receive_layout(0, "gloo")
        results.append({"ok": layout == snap.layout()})
    except Exception as exc:
        results.append({"error": type(exc).__name__, "kind": classify(exc).kind, "message": str(exc)})
print(json.dumps(results), flush=True)
"""


def test_a_crafted_layout_runs_no_code_and_is_a_ring_failure(tmp_path):
    marker = tmp_path / "marker"
    store = tmp_path / "store"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(rank), str(store), str(marker)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank, script in ((0, _PEER), (1, _RECEIVER))]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outputs]
    results = json.loads(outputs[1][0].strip().splitlines()[-1])
    assert not marker.exists()
    for result in results[:3]:
        assert result.get("error") == "PeerDataInvalid" and result["kind"] == RING, result
    assert "not plain data" in results[0]["message"]
    assert "does not lie inside its buffer" in results[1]["message"]
    assert "memory" in results[2]["message"]
    assert results[3] == {"ok": True}
    assert results[4]["error"] == "PeerDataInvalid" and "bound" in results[4]["message"]


def _layout():
    snap = Snapshot()
    snap.capture({"model": {"w": torch.ones(2, 3), "b": torch.zeros(3, dtype=torch.int64)},
                  "values": {"epoch": 2, "seen": [1, 2, 3], "name": "x", "raw": b"\x00"}})
    return snap.layout()


def test_a_layout_round_trips_as_plain_data():
    layout = _layout()
    assert layout_wire.decode(layout_wire.encode(layout), limit=1 << 20) == layout


def _buffer0(fields):  # [dtype, kind, numel] of the first buffer
    return fields["buffers"][1][0][1]


def _tensor1(fields):  # [path, shape, dtype, kind, buffer, offset] of the second tensor
    return fields["tensors"][1][1][1]


@pytest.mark.parametrize("mutate, words", [
    (lambda f: f["tensors"][1].append(["l", []]), "a tensor must be"),
    (lambda f: _buffer0(f).__setitem__(0, "torch.evil"), "unknown dtype"),
    (lambda f: _buffer0(f).__setitem__(1, "tpu"), "device kind"),
    (lambda f: _buffer0(f).__setitem__(2, -1), "must be a count"),
    (lambda f: _tensor1(f).__setitem__(4, 7), "names buffer 7"),
    (lambda f: f.update(plains=["l", []]), "plain values"),
    (lambda f: f.update(treedef=["t", ["X"]]), "malformed tree node"),
    (lambda f: f.update(extra=1), "expected treedef"),
])
def test_a_malformed_layout_is_refused_naming_what_is_wrong(mutate, words):
    # The layout is ["d", [[field, value], ...]]: change one field in its tagged form.
    fields = {key: value for key, value in json.loads(layout_wire.encode(_layout()))[1]}
    mutate(fields)
    data = json.dumps(["d", [[key, value] for key, value in fields.items()]]).encode()
    with pytest.raises(PeerDataInvalid, match=words):
        layout_wire.decode(data, limit=1 << 20)


@pytest.mark.parametrize("data", [
    b"\x80\x04K\x01.",  # a pickle
    b'{"a": 1}',  # a JSON object where tagged data is expected
    b'["x", 1]',  # an unknown tag
    b'["b", "not base64!"]',
    b'["T", "torch.float32", [2], "AAAA", "cpu"]',  # a tensor where none is allowed
    b"[" * 100000,  # deeper than any parser should follow
])
def test_the_codec_refuses_anything_but_its_own_kinds(data):
    with pytest.raises(PeerDataInvalid):
        wire.loads(data, "test", limit=1 << 20)


def test_the_codec_bounds_the_size_before_parsing():
    with pytest.raises(PeerDataInvalid, match="more than"):
        wire.loads(b"1" * 100, "test", limit=10)


def test_tensors_travel_only_where_allowed_and_with_their_size_checked():
    value = {"t": torch.arange(6, dtype=torch.float64).reshape(2, 3), "e": torch.empty(0, 4)}
    back = wire.loads(wire.dumps(value, tensors=True), "test", limit=1 << 20, tensors=True)
    assert torch.equal(back["t"], value["t"]) and back["e"].shape == (0, 4)
    short = json.dumps(["T", "torch.float64", [2, 3], "AAAA", "cpu"]).encode()
    with pytest.raises(PeerDataInvalid, match="needs 48 bytes"):
        wire.loads(short, "test", limit=1 << 20, tensors=True)


def test_peer_data_invalid_is_a_ring_failure():
    assert classify(PeerDataInvalid("x")).kind == RING
