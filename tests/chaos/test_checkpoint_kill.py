"""SIGKILL a process that writes durable checkpoints, 20 times.

After every kill the newest valid checkpoint must load, its content must match its step,
progress is never lost (the newest valid step never goes back), and a partial write
(a leftover .tmp-* dir) is never taken as a checkpoint.

Each writer first publishes one new step (awaited, so progress does not depend on the
machine's speed). Then most are killed at a random moment; every fourth is held between
writing its data and its manifest and killed there, so kills in the middle of a write
are certain, not left to chance.

The writer runs in a process forked from the test (torch is already imported here, so a
restart costs milliseconds instead of a 2 s interpreter start).
"""
import multiprocessing
import os
import random
import time

import pytest
import torch

from elastic.checkpoint import CheckpointPolicy, DurableWriter, list_checkpoints, load_latest
from elastic.checkpoint import manifest as mf
from tests.fakes.waiting import poll

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

KILLS = 20
HELD_EVERY = 4  # every 4th writer is killed while held in the middle of a write
NUMEL = 1 << 20  # 4 MiB of float32 per checkpoint


class _HeldWriter(DurableWriter):
    """After its first checkpoint, stops for good between the data and the manifest."""

    def __init__(self, *args, held, **kwargs):
        super().__init__(*args, **kwargs)
        self._held = held
        self._published = 0

    def _write_state(self, path):
        result = super()._write_state(path)
        if self._published:
            self._held.set()  # state.pt is complete and fsynced, the manifest is not written
            time.sleep(3600)
        self._published += 1
        return result


def _writer_loop(directory: str, held=None) -> None:
    """Resume from the newest valid checkpoint and write one per step, forever."""
    torch.set_num_threads(1)  # OpenMP thread pools do not survive fork()
    loaded = load_latest(directory)
    step = loaded[1]["step"] + 1 if loaded else 0
    policy = CheckpointPolicy(directory, keep=3)
    writer = _HeldWriter(policy, held=held) if held is not None else DurableWriter(policy)
    while True:
        writer.submit({"w": torch.full((NUMEL,), float(step)), "values": {"step": step}}, step=step)
        writer.flush()
        step += 1


def _check_all(directory: str) -> int | None:
    """Every checkpoint reported valid holds its own step; returns the newest valid step."""
    infos = list_checkpoints(directory)
    for info in infos:
        assert not os.path.basename(info.path).startswith(mf.TMP_PREFIX)
        if info.valid:
            tree = torch.load(os.path.join(info.path, mf.STATE_NAME), weights_only=True)
            assert tree["values"]["step"] == info.step
            assert torch.equal(tree["w"], torch.full((NUMEL,), float(info.step))), info.path
    loaded = load_latest(directory)
    if loaded is None:
        assert not any(info.valid for info in infos)
        return None
    tree, manifest = loaded
    assert manifest["step"] == tree["values"]["step"]
    assert tree["w"].min().item() == tree["w"].max().item() == float(manifest["step"])
    return manifest["step"]


def _tmp_dirs(directory: str) -> set[str]:
    try:
        return {n for n in os.listdir(directory) if n.startswith(mf.TMP_PREFIX)}
    except FileNotFoundError:
        return set()


def _newest_step(directory: str) -> int:
    loaded = load_latest(directory)
    return -1 if loaded is None else loaded[1]["step"]


def test_sigkill_at_random_moments_never_yields_a_partial_checkpoint(tmp_path):
    directory = str(tmp_path / "ckpt")
    ctx = multiprocessing.get_context("fork")
    rng = random.Random(1234)
    newest = None
    kills_mid_write = 0
    for kill in range(KILLS):
        held = ctx.Event() if kill % HELD_EVERY == HELD_EVERY - 1 else None
        before = _newest_step(directory)
        proc = ctx.Process(target=_writer_loop, args=(directory, held), daemon=True)
        proc.start()
        try:
            assert poll(lambda: _newest_step(directory) > before, timeout=60), "the writer made no progress"
            if held is not None:
                assert held.wait(60), "the writer was not held mid-write"
            else:
                time.sleep(rng.uniform(0.0, 0.3))  # the random moment of the kill
        finally:
            proc.kill()
            proc.join(timeout=30)
        assert proc.exitcode == -9
        mine = {n for n in _tmp_dirs(directory) if n.endswith(f":{proc.pid}")}
        kills_mid_write += bool(mine)
        if held is not None:
            assert mine, "a kill held mid-write left no partial write"
        step = _check_all(directory)
        if newest is not None:
            assert step is not None and step >= newest, "a kill lost a durable checkpoint"
        assert step is not None and step > before  # the awaited progress is durable
        newest = step
    assert kills_mid_write >= KILLS // HELD_EVERY
    print(f"{KILLS} kills, {kills_mid_write} left a partial write behind, newest step {newest}")

    # A restarted writer removes the leftovers of the last kill and carries on from `newest`.
    stale = _tmp_dirs(directory)
    assert stale  # the last writer was held mid-write
    proc = ctx.Process(target=_writer_loop, args=(directory,), daemon=True)
    proc.start()
    try:
        assert poll(lambda: _newest_step(directory) > newest, timeout=60)
    finally:
        proc.kill()
        proc.join(timeout=30)
    assert _newest_step(directory) > newest
    assert not (stale & _tmp_dirs(directory))
    assert len([i for i in list_checkpoints(directory) if i.valid]) <= 3 + 1  # keep=3 (+1 mid-prune at kill)
