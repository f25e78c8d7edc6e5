"""SIGKILL a process that writes durable checkpoints, 20 times at random moments.

After every kill the newest valid checkpoint must load, its content must match its step,
progress is never lost (the newest valid step never goes back), and a partial write
(a leftover .tmp-* dir) is never taken as a checkpoint.

The writer runs in a process forked from the test (torch is already imported here, so a
restart costs milliseconds instead of a 2 s interpreter start).
"""
import multiprocessing
import os
import random
import time

import torch

from checkpoint import CheckpointPolicy, DurableWriter, list_checkpoints, load_latest
from checkpoint import manifest as mf

KILLS = 20
NUMEL = 1 << 20  # 4 MiB of float32 per checkpoint


def _writer_loop(directory: str) -> None:
    """Resume from the newest valid checkpoint and write one per step, forever."""
    torch.set_num_threads(1)  # OpenMP thread pools do not survive fork()
    loaded = load_latest(directory)
    step = loaded[1]["step"] + 1 if loaded else 0
    writer = DurableWriter(CheckpointPolicy(directory, keep=3))
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


def test_sigkill_at_random_moments_never_yields_a_partial_checkpoint(tmp_path):
    directory = str(tmp_path / "ckpt")
    ctx = multiprocessing.get_context("fork")
    rng = random.Random(1234)
    newest = None
    kills_mid_write = 0
    for _ in range(KILLS):
        proc = ctx.Process(target=_writer_loop, args=(directory,), daemon=True)
        proc.start()
        try:
            time.sleep(rng.uniform(0.05, 0.4))  # the random moment of the kill
        finally:
            proc.kill()
            proc.join(timeout=30)
        assert proc.exitcode == -9
        kills_mid_write += bool(_tmp_dirs(directory))
        step = _check_all(directory)
        if newest is not None:
            assert step is not None and step >= newest, "a kill lost a durable checkpoint"
        newest = step
    assert newest is not None and newest >= KILLS, f"too little progress: newest step {newest}"

    # A restarted writer removes the leftovers of the last kill and carries on from `newest`.
    stale = _tmp_dirs(directory)
    proc = ctx.Process(target=_writer_loop, args=(directory,), daemon=True)
    proc.start()
    try:
        deadline = time.monotonic() + 30
        while (load_latest(directory)[1]["step"] <= newest) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        proc.kill()
        proc.join(timeout=30)
    assert load_latest(directory)[1]["step"] > newest
    assert not (stale & _tmp_dirs(directory))
    assert len([i for i in list_checkpoints(directory) if i.valid]) <= 3 + 1  # keep=3 (+1 mid-prune at kill)
    print(f"{KILLS} kills, {kills_mid_write} left a partial write behind, newest step {newest}")
