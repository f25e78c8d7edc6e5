"""Two checkpoint writers in one directory (an old rank 0 still writing, a new rank 0
starting), and the publish check that refuses a write whose round is over (issue 12, item 7).

Writers are held mid-write by a gate, so the interleaving is forced, not hoped for.
"""
from __future__ import annotations

import multiprocessing
import os
import threading
import time

import torch

from elastic.checkpoint import CheckpointPolicy, DurableWriter, list_checkpoints, load_latest
from elastic.checkpoint import manifest as mf

WAIT = 30.0


class _GatedWriter(DurableWriter):
    """Its background write stops after creating its tmp dir until `gate` is set."""

    def __init__(self, *args, **kwargs):
        self.gate = threading.Event()
        self.writing = threading.Event()
        super().__init__(*args, **kwargs)

    def _write_state(self, path):
        self.writing.set()
        assert self.gate.wait(WAIT)
        return super()._write_state(path)


def _tree(step: int) -> dict:
    return {"w": torch.full((1000,), float(step)), "values": {"step": step}}


def _tmp_dirs(directory) -> list[str]:
    return [n for n in os.listdir(directory) if n.startswith(mf.TMP_PREFIX)]


def _valid_steps(directory) -> list[int]:
    return [i.step for i in list_checkpoints(str(directory)) if i.valid]


def _write(writer: DurableWriter, step: int) -> None:
    assert writer.submit(_tree(step), step=step)
    assert writer.flush(WAIT) and writer.last_error is None, writer.last_error


def test_a_new_writer_leaves_the_tmp_dir_of_a_live_writer_alone(tmp_path):
    old = _GatedWriter(CheckpointPolicy(str(tmp_path)))
    assert old.submit(_tree(10), step=10)
    assert old.writing.wait(WAIT)
    in_flight = _tmp_dirs(tmp_path)
    assert len(in_flight) == 1

    new = DurableWriter(CheckpointPolicy(str(tmp_path)))  # a new rank 0 starts
    assert _tmp_dirs(tmp_path) == in_flight
    _write(new, 20)
    old.gate.set()
    assert old.flush(WAIT)
    assert old.last_error is None, old.last_error
    assert _valid_steps(tmp_path) == [20, 10]


def test_a_stale_writers_prune_never_deletes_a_newer_checkpoint(tmp_path):
    policy = CheckpointPolicy(str(tmp_path), keep=1)
    old = _GatedWriter(policy)
    assert old.submit(_tree(10), step=10)
    assert old.writing.wait(WAIT)
    new = DurableWriter(policy)
    _write(new, 20)
    _write(new, 30)
    assert _valid_steps(tmp_path) == [30]
    old.gate.set()  # the old rank 0 publishes its step 10 late, then prunes
    assert old.flush(WAIT) and old.last_error is None
    assert 30 in _valid_steps(tmp_path)
    assert load_latest(str(tmp_path))[1]["step"] == 30
    _write(new, 40)  # the current writer's prune tidies up what the stale one left
    assert _valid_steps(tmp_path) == [40]


def test_rewriting_a_step_is_one_rename_and_the_step_never_disappears(tmp_path, monkeypatch):
    policy = CheckpointPolicy(str(tmp_path), keep=3)
    _write(DurableWriter(policy), 3)
    seen = []
    real_rename = os.rename

    def rename_then_look(src, dst):
        real_rename(src, dst)
        loaded = load_latest(str(tmp_path))  # a loader at any moment of the publish
        seen.append(None if loaded is None else loaded[1]["step"])

    monkeypatch.setattr(os, "rename", rename_then_look)
    writer = DurableWriter(policy)
    assert writer.submit({"w": torch.full((1000,), -1.0), "values": {"step": 3}}, step=3)
    assert writer.flush(WAIT) and writer.last_error is None
    monkeypatch.setattr(os, "rename", real_rename)
    assert seen == [3]  # one rename, and step 3 was loadable after it
    tree, manifest = load_latest(str(tmp_path))
    assert manifest["step"] == 3 and torch.equal(tree["w"], torch.full((1000,), -1.0))  # the rewrite wins
    assert len(list_checkpoints(str(tmp_path))) == 1  # the superseded copy is pruned


def test_two_writers_interleaved_lose_nothing(tmp_path):
    """Two writers alternate steps in one directory; every newest step stays loadable."""
    policy = CheckpointPolicy(str(tmp_path), keep=2)
    a, b = DurableWriter(policy), DurableWriter(policy)
    errors = []

    def run(writer, steps):
        for step in steps:
            if not writer.submit(_tree(step), step=step) or not writer.flush(WAIT) or writer.last_error:
                errors.append((step, writer.last_error))

    threads = [threading.Thread(target=run, args=(a, range(1, 40, 2))),
               threading.Thread(target=run, args=(b, range(2, 41, 2)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert not _tmp_dirs(tmp_path)
    steps = _valid_steps(tmp_path)
    assert steps[0] == 40 and 39 in steps and len(steps) <= 3  # keep 2 (+1 a late prune)
    for step in steps:
        tree = torch.load(os.path.join(str(tmp_path), mf.step_dirname(step), mf.STATE_NAME), weights_only=True)
        assert torch.equal(tree["w"], torch.full((1000,), float(step)))


# -- a writer in another process --------------------------------------------------------------


def _blocked_writer(directory: str, writing) -> None:
    """Start a write and hang in it (until killed), as a slow old rank 0 would."""
    torch.set_num_threads(1)

    class Hanging(DurableWriter):
        def _write_state(self, path):
            writing.set()
            time.sleep(3600)

    writer = Hanging(CheckpointPolicy(directory))
    writer.submit(_tree(5), step=5)
    writer.flush()


def test_tmp_dirs_are_removed_only_once_their_writer_process_is_gone(tmp_path):
    ctx = multiprocessing.get_context("fork")
    writing = ctx.Event()
    proc = ctx.Process(target=_blocked_writer, args=(str(tmp_path), writing), daemon=True)
    proc.start()
    try:
        assert writing.wait(WAIT)
        in_flight = _tmp_dirs(tmp_path)
        assert len(in_flight) == 1
        DurableWriter(CheckpointPolicy(str(tmp_path)))
        assert _tmp_dirs(tmp_path) == in_flight  # its writer is alive
    finally:
        proc.kill()
        proc.join(WAIT)
    DurableWriter(CheckpointPolicy(str(tmp_path)))
    assert _tmp_dirs(tmp_path) == []  # its writer is gone


def test_tmp_dirs_of_unknown_writers_are_removed_only_when_old(tmp_path):
    recent = tmp_path / ".tmp-step-000000009-deadbeef@other-host:123"
    old = tmp_path / ".tmp-step-000000008-cafe"  # no owner in the name (an older writer)
    for path in (recent, old):
        path.mkdir()
        (path / mf.STATE_NAME).write_bytes(b"partial")
    two_hours_ago = time.time() - 7200
    for path in (old / mf.STATE_NAME, old):
        os.utime(path, (two_hours_ago, two_hours_ago))
    DurableWriter(CheckpointPolicy(str(tmp_path)))
    assert sorted(_tmp_dirs(tmp_path)) == [recent.name]


# -- the publish check: a write whose round is over is not published -------------------------------


def test_a_write_whose_round_is_over_is_refused_right_before_publishing(tmp_path):
    writer = _GatedWriter(CheckpointPolicy(str(tmp_path)))
    _ = writer.gate.set()
    _write(writer, 1)
    writer.gate.clear()
    current = [True]
    checks = []

    def still_current():
        checks.append(current[0])
        return current[0]

    assert writer.submit(_tree(2), step=2, round=7, still_current=still_current)
    assert writer.writing.wait(WAIT)
    current[0] = False  # round 7 ends while the state is being written
    writer.gate.set()
    assert writer.flush(WAIT)
    assert checks == [False]  # checked once, after the data was written
    assert writer.last_error is not None and "round 7" in writer.last_error
    assert _valid_steps(tmp_path) == [1] and not _tmp_dirs(tmp_path)

    def broken():
        raise RuntimeError("etcd unreachable")

    assert writer.submit(_tree(3), step=3, round=8, still_current=broken)
    assert writer.flush(WAIT)
    assert _valid_steps(tmp_path) == [1]  # a publish check that cannot be made refuses
    assert writer.submit(_tree(4), step=4, round=8, still_current=lambda: True)
    assert writer.flush(WAIT) and writer.last_error is None
    assert _valid_steps(tmp_path) == [4, 1]
