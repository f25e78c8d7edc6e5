"""An opaque stream in a state: Hugging Face ``datasets`` streaming local Parquet files, split
by rank, read by torchdata's StatefulDataLoader (2 workers), committed as a StatefulStream.
The proof job of tests/integration/test_stream_run.py.

Files written to --out (one line per event, flushed at once):
  pids.jsonl      {"pid", "rank", "round", "world"} at every (re-)entry
  steps.jsonl     {"pid", "rank", "world", "round", "step", "ids"} per step
  killed-<step>   written by --kill-rank right before it SIGKILLs itself (once per job)
"""

import argparse
import glob
import json
import os
import signal
import time

os.environ["HF_DATASETS_OFFLINE"] = "1"  # the files are the test's: nothing is downloaded

import datasets  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from datasets.distributed import split_dataset_by_node  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

import elastic  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--data", required=True, help="a folder of Parquet files with an 'id' column")
p.add_argument("--steps", type=int, default=16)
p.add_argument("--batch-size", type=int, default=5)
p.add_argument("--kill-rank", type=int, default=None)
p.add_argument("--kill-step", type=int, default=None, help="... SIGKILLs itself after training this step, "
               "before committing it (once per job)")
p.add_argument("--hold-at-step", type=int, default=None, help="from this step on, the ring commits without "
               "taking batches until it has --hold-until-world workers (a joiner switches in at a commit)")
p.add_argument("--hold-until-world", type=int, default=3)
p.add_argument("--step-delay", type=float, default=0.0)
p.add_argument("--out", required=True)
args = p.parse_args()

torch.set_default_dtype(torch.float64)
elastic.init()
os.makedirs(args.out, exist_ok=True)
files = sorted(glob.glob(os.path.join(args.data, "*.parquet")))


def append(name, record):
    with open(os.path.join(args.out, name), "a") as f:
        f.write(json.dumps(record) + "\n")


def make(rank, world):
    stream = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True,
                                   cache_dir=os.path.join(args.out, "hf-cache"))
    return StatefulDataLoader(split_dataset_by_node(stream, rank, world), batch_size=args.batch_size, num_workers=2)


model = torch.nn.Linear(1, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
state = elastic.TorchState(model=model, optimizer=optimizer, stream=elastic.StatefulStream(make), step=0)


def held() -> bool:
    return args.hold_at_step is not None and state.step >= args.hold_at_step \
        and elastic.size() < args.hold_until_world


@elastic.run
def train(state):
    where = {"pid": os.getpid(), "rank": elastic.rank(), "round": elastic.round(), "world": elastic.size()}
    append("pids.jsonl", where)
    batches = iter(state.stream)  # a changed world size is refused here, before a batch is read
    while state.step < args.steps:
        while held():  # hold before taking a batch: a commit counts the batches taken as trained
            dist.barrier()  # the ranks' commits in step: they must all switch at the same one
            time.sleep(0.1)
            state.commit()
        batch = next(batches)
        ids = batch["id"].to(torch.float64)
        loss = (state.model(ids[:, None]) ** 2).sum()
        state.optimizer.zero_grad()
        loss.backward()
        for param in state.model.parameters():
            dist.all_reduce(param.grad)
        state.optimizer.step()
        state.step += 1
        append("steps.jsonl", {**where, "step": state.step, "ids": batch["id"].tolist()})
        if state.step == args.kill_step and elastic.rank() == args.kill_rank:
            marker = os.path.join(args.out, f"killed-{state.step}")
            if not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(args.step_delay)
        state.commit()


train(state)
