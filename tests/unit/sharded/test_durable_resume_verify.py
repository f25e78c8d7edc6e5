"""gpu review 3, N4: a sharded resume from a durable checkpoint. Rank 0 names the checkpoint
after a scan of manifests and sizes (no checksum: 1 TB takes 10-20 min to hash), the
other ranks wait for its answer as long as State.sync's receivers wait for a durable
load, and every rank verifies its share of the checksums during the load: a checkpoint
whose bytes are wrong is still refused, for the next older one, before training resumes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from elastic.checkpoint import CheckpointPolicy, CheckpointsUnreadable
from elastic.checkpoint import manifest as mf
from elastic.checkpoint import restore
from elastic.sharded import durable, meta_wire, resume_check
from tests.unit.checkpoint.test_storage_faults import Storage
from tests.unit.sharded.test_sharded_durable import publish


def ring(rank=0, world=1, rdzv_timeout=30.0, collective_timeout=1.0):
    config = SimpleNamespace(rdzv_timeout=rdzv_timeout, collective_timeout=collective_timeout)
    return SimpleNamespace(rank=rank, world_size=world, backend="gloo", config=config)


def two_steps(directory):
    writer = durable.ShardedCheckpoints(CheckpointPolicy(str(directory)))
    publish(writer, 5)
    publish(writer, 10)
    return directory / mf.step_dirname(5), directory / mf.step_dirname(10)


def flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))


def test_the_resume_scan_reads_no_checksum(tmp_path, monkeypatch):
    two_steps(tmp_path)

    def no_hashing(path):
        raise AssertionError(f"hashed {path} before answering")

    monkeypatch.setattr(mf, "file_digest", no_hashing)
    path, manifest = resume_check.newest_for_resume(CheckpointPolicy(str(tmp_path)))
    assert manifest["step"] == 10


def test_the_resume_scan_skips_a_truncated_file(tmp_path):
    _, newest = two_steps(tmp_path)
    shard = newest / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1])
    assert resume_check.newest_for_resume(CheckpointPolicy(str(tmp_path)))[1]["step"] == 5


def test_a_corrupt_file_of_the_right_size_is_refused_at_its_load_for_the_older_one(tmp_path):
    older, newest = two_steps(tmp_path)
    flip_a_byte(newest / "__0_0.distcp")
    policy = CheckpointPolicy(str(tmp_path))
    found = resume_check.newest_for_resume(policy)
    assert found[0] == str(newest)  # sizes only: the scan cannot tell
    loads = []
    assert resume_check.load_verified(ring(), found, lambda: loads.append(found[0]) or "state", False) == (False, None)
    found = resume_check.newest_for_resume(policy, rejected=[found[0]])
    assert found[0] == str(older)
    assert resume_check.load_verified(ring(), found, lambda: loads.append(found[0]) or "state", False) == (True, "state")
    assert loads == [str(newest), str(older)]


def test_a_load_that_fails_is_a_mismatch_when_the_checksums_say_so_else_its_error(tmp_path):
    older, newest = two_steps(tmp_path)
    flip_a_byte(newest / "__0_0.distcp")

    def failing_load():
        raise RuntimeError("DCP could not read the shard")

    assert resume_check.load_verified(ring(), (str(newest), mf.read_manifest(str(newest))), failing_load,
                                 False) == (False, None)
    with pytest.raises(RuntimeError, match="could not read"):
        resume_check.load_verified(ring(), (str(older), mf.read_manifest(str(older))), failing_load, False)


def test_a_file_that_cannot_be_read_while_verified_is_retried_then_fails_the_job_unless_skipped(tmp_path,
                                                                                                 monkeypatch):
    _, newest = two_steps(tmp_path)
    found = (str(newest), mf.read_manifest(str(newest)))
    storage = Storage(monkeypatch, newest / "__0_0.distcp")
    monkeypatch.setattr(restore, "RETRY_DELAYS", (0.01, 0.01))
    with pytest.raises(CheckpointsUnreadable, match="--checkpoint-allow-fresh-start"):
        resume_check.load_verified(ring(), found, lambda: "state", False)
    assert storage.calls == 3  # tried again as the scan is
    assert resume_check.load_verified(ring(), found, lambda: "state", True) == (False, None)


def test_every_file_is_verified_by_one_rank_each_dcp_file_by_the_rank_that_wrote_it():
    files = {"__0_0.distcp": {"size": 100}, "__1_0.distcp": {"size": 100}, "__2_0.distcp": {"size": 100},
             ".metadata": {"size": 10}, mf.STATE_NAME: {"size": 5}}
    assert resume_check.hash_shares(files, 3) == [["__0_0.distcp", ".metadata"], ["__1_0.distcp", mf.STATE_NAME],
                                             ["__2_0.distcp"]]
    assert resume_check.hash_shares(files, 2) == [["__0_0.distcp", "__2_0.distcp"],
                                             ["__1_0.distcp", ".metadata", mf.STATE_NAME]]
    for world in (1, 2, 3, 7):
        shares = resume_check.hash_shares(files, world)
        assert sorted(n for share in shares for n in share) == sorted(files)


def test_the_others_wait_for_rank_0s_answer_as_long_as_for_a_durable_load(monkeypatch):
    waits = []
    monkeypatch.setattr(meta_wire, "broadcast_found",
                        lambda found, rank, world, backend, wait_s=None: waits.append(wait_s))
    resume_check.agree_on_newest(ring(rank=1, world=2, rdzv_timeout=900.0, collective_timeout=60.0), None)
    resume_check.agree_on_newest(ring(rank=1, world=2, rdzv_timeout=30.0, collective_timeout=120.0), None)
    assert waits == [900.0, 120.0]  # max(--rdzv-timeout, --collective-timeout): State.sync's wait


_SCRIPT = """
import datetime, json, os, sys, time, torch.distributed as dist
from types import SimpleNamespace
from elastic.sharded import durable, meta_wire, resume_check
rank, store_path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=1))
ring = SimpleNamespace(rank=rank, world_size=2, backend="gloo",
                       config=SimpleNamespace(rdzv_timeout=30.0, collective_timeout=1.0))
checkpoints = SimpleNamespace(policy=None) if rank == 0 else None
def slow_scan(policy, rejected=()):
    time.sleep(3)  # a directory on a slow file server: longer than the group's timeout
    return ("/ckpt/step-000000010", {"step": 10})
resume_check.newest_for_resume = slow_scan
started = time.monotonic()
found = resume_check.agree_on_newest(ring, checkpoints)
waited_found = time.monotonic() - started
if rank == 1:
    time.sleep(3)  # this rank's share of the checksums takes longer than the group's timeout
started = time.monotonic()
worst = meta_wire.worst_verdict(1 if rank == 1 else 0, rank, 2, "gloo", 30.0, codes=3)
waited_verdict = time.monotonic() - started
dist.barrier()
print(json.dumps({"found": list(found), "worst": worst, "waited_found": waited_found,
                  "waited_verdict": waited_verdict}), flush=True)
dist.destroy_process_group()
"""


def test_rank_0s_answer_and_the_verdicts_may_take_longer_than_the_collective_timeout(tmp_path):
    """A real gloo ring of two processes whose group timeout is 1 s: rank 0 scans for 3 s, then
    rank 1 verifies for 3 s. Both wait, and both learn the worst verdict."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    procs = [subprocess.Popen([sys.executable, "-c", _SCRIPT, str(rank), str(tmp_path / "store")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outputs]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    for result in results:
        assert result["found"] == ["/ckpt/step-000000010", {"step": 10}] and result["worst"] == 1, result
    assert results[1]["waited_found"] > 2.0 and results[0]["waited_verdict"] > 2.0, results


# -- a whole resume, in this process: a world of one over gloo, a real FSDP2 model and DCP ------------

def job_ring(directory, round_number):
    config = SimpleNamespace(checkpoint_dir=str(directory), checkpoint_every=1, checkpoint_interval=None,
                             checkpoint_keep=5, checkpoint_allow_fresh_start=False, job_id=None,
                             rdzv_timeout=30.0, collective_timeout=5.0, worker_id="w0", shard_replicas=0)
    return SimpleNamespace(rank=0, world_size=1, round=round_number, backend="gloo", config=config, plan=None,
                           progress_board=None, events=SimpleNamespace(emit=lambda *args, **kwargs: None),
                           publish_check=lambda: None)


@pytest.fixture
def world_of_one(monkeypatch):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from elastic.sharded import state as sharded_state

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    monkeypatch.setattr(sharded_state, "device_mesh", lambda: init_device_mesh("cpu", (1,)))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_sharded_resume_refuses_a_checkpoint_whose_bytes_are_wrong_for_the_older_one(tmp_path, world_of_one,
                                                                                      caplog):
    import torch

    from elastic.sharded import ShardedState

    def new_state():
        torch.manual_seed(0)
        return ShardedState(model=lambda: torch.nn.Sequential(torch.nn.Linear(4, 3)),
                            optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1), epoch=0)

    state, ring1 = new_state(), job_ring(tmp_path, 1)
    state.sync(ring1)
    weights = []
    for value in (1.0, 2.0):  # two commits, each written durably (every commit)
        with torch.no_grad():
            for p in state.model.parameters():
                p.to_local().fill_(value)
        state._capture(ring1)
        state.flush_checkpoints(ring1)
        weights.append(value)
    names = sorted(n for n in os.listdir(tmp_path) if mf.parse_checkpoint_dirname(n))
    assert names == [mf.step_dirname(1), mf.step_dirname(2)]
    newest = tmp_path / names[-1]
    shard = newest / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # the same size: only the checksum tells
    shard.write_bytes(bytes(data))

    fresh = new_state()  # every copy lost: a new process resumes from disk
    with caplog.at_level("WARNING"):
        fresh.sync(job_ring(tmp_path, 2))
    assert f"{newest} does not verify: __0_0.distcp sha256 mismatch" in caplog.text
    assert fresh.epoch == 0 and fresh._book.count == 1
    assert all(torch.equal(p.to_local(), torch.full_like(p.to_local(), 1.0)) for p in fresh.model.parameters())
    assert fresh._book.durable.resumed_from == 1
