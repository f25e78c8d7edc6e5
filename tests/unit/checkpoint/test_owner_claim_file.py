"""A checkpoint directory's claim (job.json) is read bounded, never followed, never waited
for (security review 2, L2: job.json -> /dev/zero exhausted memory; a FIFO blocked the
launcher and every publish)."""

from __future__ import annotations

import os
import threading

import pytest

from checkpoint import owner


@pytest.mark.parametrize("make", ["dev-zero", "fifo", "huge", "link-to-claim"])
def test_a_claim_that_is_no_regular_small_file_is_no_claim_and_is_refused(tmp_path, make):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    path = directory / owner.OWNER_NAME
    if make == "dev-zero":
        path.symlink_to("/dev/zero")
    elif make == "fifo":
        os.mkfifo(path)
    elif make == "huge":
        path.write_bytes(b'{"job_id": "x", "pad": "' + b"p" * 100_000 + b'"}')
    else:
        real = tmp_path / "elsewhere.json"
        real.write_text('{"job_id": "victim"}')
        path.symlink_to(real)
    answers = []
    reader = threading.Thread(target=lambda: answers.append(owner.owner_of(str(directory))), daemon=True)
    reader.start()
    reader.join(5)
    assert answers == [None]  # at once, and no claim
    assert owner.refusal(str(directory), "mine") is None
    with pytest.raises(owner.DirectoryTaken, match="is not a job's claim"):
        owner.claim(str(directory), "mine")
    owner.claim(str(directory), "mine", take_over=True)  # explicitly taken over: replaced by a real claim
    assert owner.owner_of(str(directory)) == "mine"
