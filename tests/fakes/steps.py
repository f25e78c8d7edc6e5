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
