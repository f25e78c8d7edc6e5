"""An opaque stream (Hugging Face datasets streaming local Parquet, torchdata's
StatefulDataLoader with 2 workers) through a kill: the same world size resumes exactly;
a join that changes the world size is refused in one line, never trained through.

Real etcd, a real elastic-run agent, real gloo. Rank 1 is SIGKILLed after training a
step it has not committed; its agent replaces it (--min-np 2: the ring waits), and the
replacement takes rank 1's committed position. Then a second agent joins (world 3):
every rank refuses at its next iteration, naming ShardedSource, and the job fails.
"""

from __future__ import annotations

import os
import uuid

import pytest

from tests.fakes.jobs import REPO, Job, read_jsonl, wait_until

pytestmark = pytest.mark.timeout(300)

STREAM_JOB = REPO / "tests" / "fakes" / "stream_job.py"
FILES, ROWS, BATCH = 4, 50, 5


def write_parquet(folder) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir()
    for k in range(FILES):
        pq.write_table(pa.table({"id": list(range(k * ROWS, (k + 1) * ROWS))}), folder / f"part-{k}.parquet",
                       row_group_size=20)
    return str(folder)


def split_sequence(data: str, rank: int, world: int, cache: str) -> list[list[int]]:
    """The batches rank ``rank`` of ``world`` reads, in order, with nothing interrupted."""
    import datasets
    from datasets.distributed import split_dataset_by_node
    from torchdata.stateful_dataloader import StatefulDataLoader

    files = sorted(str(p) for p in __import__("pathlib").Path(data).glob("*.parquet"))
    stream = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True, cache_dir=cache)
    loader = StatefulDataLoader(split_dataset_by_node(stream, rank, world), batch_size=BATCH, num_workers=2)
    return [batch["id"].tolist() for batch in loader]


def first_pids(out) -> set[int]:
    entries = read_jsonl(out / "pids.jsonl")
    return {e["pid"] for e in entries if e["round"] == min(x["round"] for x in entries)}


def agent(home, endpoint, job_id, host, nproc, script, launcher=()):
    home.mkdir(exist_ok=True)
    job = Job(home, ["--rdzv-endpoint", endpoint, "--job-id", job_id, "--host-id", host, "--host-addr", "127.0.0.1",
                     "--nproc-per-node", str(nproc), "--min-np", "2", "--max-np", "3", *launcher,
                     "--log-dir", str(home / "logs"), str(STREAM_JOB), *script],
              name=host, env={"HF_DATASETS_OFFLINE": "1"})
    job.log_dir = home / "logs"
    return job


@pytest.mark.slow  # ~39 CPU s (4 worker starts importing datasets); tests/unit/data/test_stream.py runs by default
def test_a_stream_resumes_exactly_at_the_same_world_size_and_refuses_another(tmp_path, etcd_server):
    pytest.importorskip("datasets")
    pytest.importorskip("torchdata")
    data = write_parquet(tmp_path / "data")
    out = tmp_path / "out"
    script = ["--data", data, "--out", str(out), "--steps", "18", "--kill-rank", "1", "--kill-step", "4",
              "--hold-at-step", "8", "--step-delay", "0.05"]
    job_id = f"stream-{uuid.uuid4().hex[:8]}"
    a = agent(tmp_path / "a", etcd_server.endpoint, job_id, "host-a", 2, script, ["--max-restarts", "1"])
    jobs = [a]
    try:
        # The kill at step 4, the replacement, the ring of 2 that has it trains to step 8 and
        # holds there (commits, no batches taken) until the joiner switches in.
        wait_until(lambda: (out / "killed-4").exists(), 180, "the kill")
        wait_until(lambda: any(s["step"] == 8 and s["pid"] not in first_pids(out)
                               for s in read_jsonl(out / "steps.jsonl")), 180, "the replacement to train step 8")
        b = agent(tmp_path / "b", etcd_server.endpoint, job_id, "host-b", 1, script)
        jobs.append(b)
        code = a.wait(180)
    finally:
        for job in jobs:
            job.kill()
    assert code != 0
    refusal = "StatefulStream: its position was committed at world size 2, the ring now has 3"
    assert refusal in a.text() and "elastic.ShardedSource" in a.text(), a.text()[-3000:]

    records = read_jsonl(out / "steps.jsonl")
    newest: dict[tuple, int] = {}
    for s in records:
        newest[(s["step"], s["rank"])] = max(newest.get((s["step"], s["rank"]), 0), s["round"])
    kept = {(s["step"], s["rank"]): s["ids"] for s in records if s["round"] == newest[(s["step"], s["rank"])]}
    assert {s["world"] for s in records} == {2}, "no step may run at world 3"
    steps = max(step for step, _ in kept)
    assert steps == 8, "the ring trained to step 8 after the kill, then held"
    cache = str(tmp_path / "hf-cache")
    for rank in range(2):
        expected = split_sequence(data, rank, 2, cache)
        assert [kept[(step, rank)] for step in range(1, steps + 1)] == expected[:steps], f"rank {rank}"
    pids_of_rank1 = {s["pid"] for s in records if s["rank"] == 1}
    assert len(pids_of_rank1) == 2, "rank 1's steps after the kill come from its replacement"
