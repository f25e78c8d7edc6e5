"""Accounting over the steps.jsonl that tests/fakes/train_job.py writes."""

from __future__ import annotations


def committed_samples(steps: list[dict]) -> list[int]:
    """The samples of the committed trajectory, sorted (a duplicate stays in).

    Every rank logs a step's whole global batch before committing it, so a step counts
    once ANY rank logged it: a worker killed after the step's all-reduce but before its
    own log line had its share trained on, and the survivors committed it. A step run
    again after a rollback (a new round) supersedes its earlier attempt: per step
    number, the records of the newest round that ran it are the committed ones.
    """
    newest: dict[int, dict] = {}
    for s in steps:
        kept = newest.get(s["step"])
        if kept is None or s["round"] > kept["round"]:
            newest[s["step"]] = s
        elif s["round"] == kept["round"]:
            assert s["batch"] == kept["batch"], f"ranks disagree on step {s['step']}: {s} vs {kept}"
    assert sorted(newest) == list(range(1, max(newest) + 1)), "a step is missing from every log"
    return sorted(i for s in newest.values() for i in s["batch"])


def step_attempts(steps: list[dict]) -> dict[int, set[int]]:
    """Per step number, the rounds in which some rank recorded it.

    Any rank's record counts, for the reason ``committed_samples`` gives: a rank 0 killed
    between a step's all-reduce and its record leaves that step trained and committed by
    the survivors, recorded only under their (old) ranks. A step recorded in two rounds
    was run again after a rollback; a step recorded in none was never trained.
    """
    rounds: dict[int, set[int]] = {}
    for s in steps:
        rounds.setdefault(s["step"], set()).add(s["round"])
    return rounds


def missing_steps(attempts: dict[int, set[int]], last: int) -> list[int]:
    return [step for step in range(1, last + 1) if step not in attempts]


def steps_run_again(attempts: dict[int, set[int]]) -> int:
    return sum(len(rounds) - 1 for rounds in attempts.values())
