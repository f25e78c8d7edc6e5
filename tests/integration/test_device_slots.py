"""Device slots and broken processes end to end: real etcd, a real agent, real gloo workers.

A host of four workers loses the one in slot 1 (SIGKILL): its replacement gets slot 1
(LOCAL_RANK=1, elastic.local_rank() == 1) while the survivors keep theirs through every
round, although their positions in the plan shift. Later another worker raises
torch.AcceleratorError (a sticky CUDA error, as on an illegal address): it exits as a
broken process, its agent replaces it on its slot like a crash, and the job completes.
Without a restart left, a broken process is not a user error: the job fails on being
too small, and the line that names the broken process is on the console.
"""

from __future__ import annotations

import pytest

from elastic.contract.exit_codes import USER_ERROR, WORKER_BROKEN
from tests.fakes.jobs import Job, read_jsonl

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]  # real jobs with replacements: the slow run

ERROR = "AcceleratorError: CUDA error: an illegal memory access was encountered"


def _events(tmp_path, name):
    return [e for e in read_jsonl(tmp_path / "logs" / "events.jsonl") if e["event"] == name]


def test_a_replacement_takes_the_freed_slot_and_survivors_keep_theirs(tmp_path):
    launcher = ["--np", "4", "--max-restarts", "2", "--collective-timeout", "20"]
    script = ["--steps", "24", "--step-delay", "0.02", "--record-slots", "--hold-below-world", "4",
              "--kill-at", "4:after-allreduce", "--kill-rank", "1",
              "--accelerator-error-rank", "2", "--accelerator-error-step", "14"]
    job = Job(tmp_path, Job.train_args(tmp_path / "out", tmp_path / "logs", launcher, script))
    try:
        assert job.wait(300) == 0, job.text()[-3000:]
    finally:
        job.kill()
    entries = read_jsonl(tmp_path / "out" / "slots.jsonl")
    slot_of: dict[int, set] = {}
    for e in entries:
        assert e["local_rank"] == e["env_local_rank"], e  # elastic.local_rank() is LOCAL_RANK
        slot_of.setdefault(e["pid"], set()).add(e["local_rank"])
    assert all(len(slots) == 1 for slots in slot_of.values()), slot_of  # nobody ever moved
    first_round = min(e["round"] for e in entries)
    first = {e["pid"]: e["local_rank"] for e in entries if e["round"] == first_round}
    assert sorted(first.values()) == [0, 1, 2, 3], entries
    assert all(e["rank"] == e["local_rank"] for e in entries if e["round"] == first_round)
    killed = next(pid for pid, slot in first.items() if slot == 1)
    broken = int((tmp_path / "out" / "accelerator-error-14").read_text())
    broken_slot = slot_of[broken].pop()
    # Two replacements: one on the killed worker's slot 1, one on the broken worker's slot.
    replacements = {pid: slots.pop() for pid, slots in slot_of.items() if pid not in first}
    assert sorted(replacements.values()) == sorted([1, broken_slot]), (replacements, broken_slot)
    started = _events(tmp_path, "worker_started")
    assert [e["slot"] for e in started[:4]] == [0, 1, 2, 3] and len(started) == 6, started
    assert sorted(e["slot"] for e in started[4:]) == sorted([1, broken_slot]), started
    # Survivors' positions in the plan shifted (w0, w2, w3 ranks 0-2), their slots did not.
    shifted = [e for e in entries if e["pid"] in first and e["pid"] not in (killed, broken) and e["round"] > first_round
               and e["rank"] != e["local_rank"]]
    assert shifted, "no survivor changed rank: the test would not show a slot kept across a shift"
    exits = {e["worker"]: e for e in _events(tmp_path, "worker_exited")}
    assert any(e["exit_code"] == WORKER_BROKEN for e in exits.values()), exits
    failures = [e["reason"] for e in _events(tmp_path, "failure_detected") if "broken process" in e.get("reason", "")]
    assert len(failures) == 1 and ERROR in failures[0], failures
    assert " failed: " not in job.text()  # never a user error


def test_a_broken_process_with_no_restart_left_is_no_user_error(tmp_path):
    launcher = ["--np", "2", "--min-np", "2", "--max-restarts", "0", "--rdzv-timeout", "5",
                "--collective-timeout", "20"]
    script = ["--steps", "100000", "--step-delay", "0.02", "--accelerator-error-rank", "1",
              "--accelerator-error-step", "3"]
    job = Job(tmp_path, Job.train_args(tmp_path / "out", tmp_path / "logs", launcher, script))
    try:
        code = job.wait(180)
    finally:
        job.kill()
    text = job.text()
    assert code not in (0, USER_ERROR), text[-3000:]
    lines = text.splitlines()
    named = [line for line in lines if "broken process" in line and ERROR in line]
    assert named, text[-3000:]  # the worker's line and the agent's failure line name it
    failed = [line for line in lines if line.startswith("elastic-run: job ") and " failed: " in line]
    assert len(failed) == 1 and "min_np=2" in failed[0] and "AcceleratorError" not in failed[0], failed
    assert "Traceback" not in "\n".join(line for line in lines if line.startswith("elastic-run:"))
