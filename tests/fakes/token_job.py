"""A small GPT-style model trained on token shards through ShardedSource, SourceSampler and
DataLoader workers: the proof job of tests/integration/test_token_shards_run.py.

float64 throughout, deterministic: the same script as a plain process (a world of one)
gives the trajectory a job that loses and gains workers must follow. Each step trains
the sampler's next global batch of --global-batch-size samples (a sum loss times
loss_scale), read by DataLoader(num_workers=--num-workers, prefetch_factor=4,
persistent_workers=True) over the shards in --data.

Files written to --out (one line per event, flushed at once):
  pids.jsonl      {"pid", "rank", "round", "world", "phase"} at every (re-)entry
  steps.jsonl     {"pid", "rank", "world", "round", "phase", "step", "epoch", "ids"} per step:
                  "ids" the sample ids this rank trained, as the loader delivered them
  loader.jsonl    {"pid", "round", "phase", "world", "first_batch_s", "workers"} at every
                  (re-)entry: seconds from entering train() to the first batch, and the
                  loader's worker pids (the same pids across rounds: workers not restarted)
  final-<pid>.pt  the final parameters
"""

import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import elastic

p = argparse.ArgumentParser()
p.add_argument("--data", required=True, help="a folder of uint16 token shards (*.bin)")
p.add_argument("--seq-len", type=int, default=16, help="tokens a sample predicts (a sample holds one more)")
p.add_argument("--vocab", type=int, default=64)
p.add_argument("--global-batch-size", type=int, default=32)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--num-workers", type=int, default=2)
p.add_argument("--window", type=int, default=128)
p.add_argument("--step-delay", type=float, default=0.0)
p.add_argument("--hold-file", default=None, help="while this file exists, the ring commits in lockstep "
               "without training (a joiner switches in at a commit); rank 0 decides for all")
p.add_argument("--phase", type=int, default=1, help="written with every record: a resumed job's records "
               "supersede those of an earlier phase")
p.add_argument("--out", required=True)
args = p.parse_args()

torch.set_default_dtype(torch.float64)
elastic.init()
os.makedirs(args.out, exist_ok=True)


def append(name, record):
    with open(os.path.join(args.out, name), "a") as f:
        f.write(json.dumps(record) + "\n")


class Block(nn.Module):
    """One pre-norm transformer block with causal self-attention."""

    def __init__(self, dim, heads):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        n = x.shape[1]
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab, seq, dim=32, heads=2, layers=2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        return self.head(self.blocks(x))


torch.manual_seed(0)
model = TinyGPT(args.vocab, args.seq_len)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
source = elastic.ShardedSource.tokens(os.path.join(args.data, "*.bin"), seq_len=args.seq_len + 1, with_ids=True)
sampler = elastic.SourceSampler(source, global_batch_size=args.global_batch_size, seed=11, window=args.window)
loader = DataLoader(source, batch_sampler=sampler, collate_fn=source.collate, num_workers=args.num_workers,
                    prefetch_factor=4 if args.num_workers else None, persistent_workers=args.num_workers > 0)
state = elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, step=0, epoch=0)


def held() -> bool:
    """Rank 0 looks for --hold-file and tells the ring: every rank holds at the same step."""
    if args.hold_file is None:
        return False
    flag = torch.tensor([1 if elastic.rank() == 0 and os.path.exists(args.hold_file) else 0])
    if elastic.size() > 1:
        dist.broadcast(flag, src=0)
    return bool(flag.item())


def hold():
    while held():
        time.sleep(0.1)
        state.commit()  # raises HostsUpdatedInterrupt at a switch: train is re-entered


@elastic.run
def train(state):
    entered = time.monotonic()
    where = {"pid": os.getpid(), "rank": elastic.rank(), "round": elastic.round(), "world": elastic.size(),
             "phase": args.phase}
    append("pids.jsonl", where)
    ddp = DDP(state.model, init_sync=False)
    first = True
    for state.epoch in range(state.epoch, args.epochs):
        state.sampler.set_epoch(state.epoch)
        for batch_idx, (ids, tokens) in enumerate(loader):
            if first:
                workers = [w.pid for w in loader._iterator._workers] if args.num_workers else []
                append("loader.jsonl", {**where, "first_batch_s": round(time.monotonic() - entered, 4),
                                        "workers": workers})
                first = False
            hold()
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
            logits = ddp(inputs)
            # A sum over the share's tokens, scaled: the mean over the global batch's tokens.
            loss = F.cross_entropy(logits.reshape(-1, args.vocab), targets.reshape(-1), reduction="sum")
            loss = loss * state.sampler.loss_scale / args.seq_len
            state.optimizer.zero_grad()
            loss.backward()
            state.optimizer.step()
            state.sampler.record_batch(batch_idx)
            state.step += 1
            append("steps.jsonl", {**where, "step": state.step, "epoch": state.epoch, "ids": ids.tolist(),
                                   "loss": None if math.isnan(loss.item()) else loss.item()})
            time.sleep(args.step_delay)
            state.commit()


train(state)
torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
           os.path.join(args.out, f"final-{os.getpid()}.pt"))
