"""What a checkpoint writer may never do: bury an earlier run's newer steps, write into
another job's directory, leave a write published once its round is over, or make the
job's state readable by other users."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from elastic.checkpoint import CheckpointPolicy, DurableWriter, PublishRefusal, list_checkpoints, load_latest
from elastic.checkpoint import manifest as mf
from elastic.checkpoint import owner
from elastic.checkpoint.retention import names_to_prune, superseded_step


def names(*keys):
    return {key: mf.checkpoint_dirname(*key) for key in keys}


@pytest.mark.parametrize("present, own, keep, resumed_from, published, pruned", [
    # keep the newest `keep` steps, only ever older than the one just published
    ([(10, 0), (20, 0), (30, 0)], (30, 0), 2, None, set(), ["step-000000010"]),
    ([(10, 0), (20, 0), (30, 0)], (20, 0), 1, None, set(), ["step-000000010"]),  # a stale writer: 30 stays
    # an older copy of a rewritten step goes
    ([(20, 0), (20, 1)], (20, 1), 3, None, set(), ["step-000000020"]),
    # a run that resumed from 10 never prunes an earlier run's 20 or 30 ...
    ([(10, 0), (20, 0), (30, 0), (40, 0), (50, 0)], (50, 0), 2, 10, {"step-000000040", "step-000000050"},
     ["step-000000010"]),
    # ... but prunes its own steps above 10
    ([(10, 0), (20, 0), (40, 0), (50, 0), (60, 0)], (60, 0), 2, 10,
     {"step-000000040", "step-000000050", "step-000000060"}, ["step-000000040", "step-000000010"]),
    # from the initial state (-1): every earlier checkpoint is kept
    ([(10, 0), (20, 0), (5, 0)], (5, 0), 1, -1, {"step-000000005"}, []),
])
def test_names_to_prune(present, own, keep, resumed_from, published, pruned):
    assert names_to_prune(names(*present), own, keep, resumed_from=resumed_from, published=published) == pruned


@pytest.mark.parametrize("present, step, resumed_from, published, buried", [
    ([(100, 0)], 100, None, set(), None),  # a running job's writer rewrites its own history
    ([(100, 0)], 100, 100, set(), None),  # the step it resumed from: not above it
    ([(100, 0)], 100, 50, set(), "step-000000100"),  # an earlier run's newer step
    ([(100, 0)], 100, -1, set(), "step-000000100"),
    ([(100, 0)], 100, 50, {"step-000000100"}, None),  # its own write of 100 (a rewrite after a rollback)
    ([(90, 0)], 100, 50, set(), None),
])
def test_superseded_step(present, step, resumed_from, published, buried):
    assert superseded_step(names(*present), step, resumed_from=resumed_from, published=published) == buried


def tree(step):
    return {"w": torch.full((8,), float(step))}


def write(writer, step, **kwargs):
    assert writer.submit(tree(step), step=step, **kwargs)
    assert writer.flush(30)
    return writer.last_error


def steps_on_disk(directory):
    return sorted(os.path.basename(c.path) for c in list_checkpoints(str(directory)) if c.valid)


def test_a_writer_that_resumed_from_an_older_step_buries_nothing_newer(tmp_path):
    """The issue's loss: a run restarted from step 0 (the newer checkpoints could not be
    read) numbers its commits from 0 again; its step-100.1 must not supersede the real
    step-100 (loaders prefer .1), and its prunes must not delete it."""
    with DurableWriter(CheckpointPolicy(str(tmp_path), keep=2)) as earlier:
        for step in (50, 100):
            assert write(earlier, step) is None
    with DurableWriter(CheckpointPolicy(str(tmp_path), keep=2), resumed_from=-1) as fresh:
        assert write(fresh, 50) is not None and "not superseding" in fresh.last_error
        assert write(fresh, 70) is None
        assert write(fresh, 100) is not None and "step-000000100 " in fresh.last_error
        for step in (120, 140, 160):
            assert write(fresh, step) is None
    # Its own older steps were pruned (keep 2); the earlier run's stayed untouched.
    assert steps_on_disk(tmp_path) == ["step-000000050", "step-000000100", "step-000000140", "step-000000160"]
    assert load_latest(str(tmp_path))[0]["w"][0] == 160


def test_without_a_resume_point_a_rewrite_supersedes_as_before(tmp_path):
    with DurableWriter(CheckpointPolicy(str(tmp_path), keep=2)) as writer:
        assert write(writer, 100) is None
    with DurableWriter(CheckpointPolicy(str(tmp_path), keep=2)) as writer:
        assert write(writer, 100) is None
    assert steps_on_disk(tmp_path) == ["step-000000100.1"]


def test_another_jobs_directory_is_refused_unless_taken_over(tmp_path):
    owner.claim(str(tmp_path), "job-a")
    owner.claim(str(tmp_path), "job-a")  # the same job again (a restart): fine
    with pytest.raises(owner.DirectoryTaken) as refused:
        owner.claim(str(tmp_path), "job-b")
    assert "job-a" in str(refused.value) and "\n" not in str(refused.value)
    owner.claim(str(tmp_path), "job-b", take_over=True)
    assert owner.owner_of(str(tmp_path)) == "job-b"


def test_a_writer_of_a_job_whose_directory_was_taken_over_publishes_and_prunes_nothing(tmp_path):
    owner.claim(str(tmp_path), "old")
    with DurableWriter(CheckpointPolicy(str(tmp_path), keep=1, job_id="old")) as writer:
        assert write(writer, 10) is None
        owner.claim(str(tmp_path), "new", take_over=True)
        assert "job 'new' took the checkpoint directory over" in write(writer, 20)
    assert steps_on_disk(tmp_path) == ["step-000000010"]


def test_a_write_whose_fence_fails_right_after_the_rename_is_taken_back(tmp_path):
    """A rename that stalled (a frozen NFS mount) while the job moved on: the publish check is
    asked again after it, and the late checkpoint does not stay published."""
    with DurableWriter(CheckpointPolicy(str(tmp_path), keep=1)) as writer:
        assert write(writer, 10) is None
        answers = iter([True, False])

        def still_current():
            if next(answers):
                return True
            raise PublishRefusal("round 3 declared this worker lost")

        error = write(writer, 20, still_current=still_current, round=2)
    assert "taken back right after publishing: round 3 declared this worker lost" in error
    assert steps_on_disk(tmp_path) == ["step-000000010"]  # and nothing pruned for it
    assert not [n for n in os.listdir(tmp_path) if n.startswith(mf.TMP_PREFIX)]


def test_checkpoints_are_private_to_the_jobs_user_whatever_the_umask(tmp_path):
    previous = os.umask(0o022)
    try:
        with DurableWriter(CheckpointPolicy(str(tmp_path / "ckpt"))) as writer:
            assert write(writer, 10) is None
        owner.claim(str(tmp_path / "ckpt"), "j")
    finally:
        os.umask(previous)
    step = tmp_path / "ckpt" / mf.step_dirname(10)
    assert stat.S_IMODE(os.stat(step).st_mode) == 0o700
    for name in (mf.STATE_NAME, mf.MANIFEST_NAME):
        assert stat.S_IMODE(os.stat(step / name).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "ckpt" / owner.OWNER_NAME).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "ckpt").st_mode) == 0o700  # created by the writer
