"""pytorch/examples' distributed/FSDP2 example, ported to elastic-run (docs/porting/from-fsdp2.md).

The structure is the example's: model.py, utils.py and its own checkpoint.py beside the
script (`from checkpoint import Checkpointer`), a Transformer sharded block by block
with fully_shard, Adam, gradient clipping. What the port changed:

- the model is a factory (`build`) and the sharding a function (`shard`) that
  ShardedState calls on every ring, instead of one fully_shard at start;
- the training loop is a function under @elastic.run that takes state.model and
  state.optimizer on each entry and commits every step;
- step t's batch is a function of t (each rank takes its rows of it), not of each
  rank's random generator, and the loss is scaled by the world size (FSDP2 averages
  gradients over the ring), so a run on any ring trains on the same data;
- resuming is ShardedState's (peers' copies, then --checkpoint-dir); the Checkpointer
  stays for the export of the finished model.

    elastic-run --np 4 --min-np 2 --checkpoint-dir /shared/ckpt example.py --steps 100 --out /shared/out
"""

import argparse
import os
import time

import torch
from torch.distributed.fsdp import fully_shard

import elastic
from checkpoint import Checkpointer
from model import ModelArgs, Transformer
from utils import inspect_model

VOCAB, SEQ_LEN = 32, 8


def forward_prefetch(model, count):
    """Each block asks FSDP2 to all-gather the next `count` blocks during its forward."""
    for i, layer in enumerate(model.layers[:-1]):
        layer.set_modules_to_forward_prefetch(list(model.layers[i + 1:i + 1 + count]))


def main(args):
    torch.set_default_dtype(torch.float64 if args.float64 else torch.float32)
    model_args = ModelArgs(n_layers=2, n_heads=2, dim=8, vocab_size=VOCAB, max_seq_len=SEQ_LEN, dropout_p=0.0)

    def build():  # called on the meta device too: no collective, no side effect
        torch.manual_seed(0)
        return Transformer(model_args)

    def shard(model, mesh):  # the example's fully_shard calls, on the ring's mesh
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if args.explicit_prefetching:
            forward_prefetch(model, 2)

    elastic.init()
    state = elastic.ShardedState(model=build, optimizer=lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
                                 shard=shard, step=0)

    @elastic.run
    def train(state):
        model, optim = state.model, state.optimizer  # new objects on every ring
        rank, world = elastic.rank(), elastic.size()
        inspect_model(model, torch.get_default_dtype())
        while state.step < args.steps:
            batch = torch.randint(0, VOCAB, (args.global_batch, SEQ_LEN),
                                  generator=torch.Generator().manual_seed(state.step))
            loss = model(batch[rank::world]).sum() * world  # FSDP2 averages: this sums the global batch
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            optim.step()
            optim.zero_grad()
            state.step += 1
            if rank == 0:
                print(f"step {state.step} world {world} loss {loss.item():.6f}", flush=True)
            time.sleep(args.step_delay)
            state.commit()
        Checkpointer(args.out).save(model, optim, state.step)

    train(state)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="PyTorch FSDP2 example on elastic-run")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--global-batch", type=int, default=12)
    parser.add_argument("--explicit-prefetching", action="store_true")
    parser.add_argument("--float64", action="store_true")
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--out", default="checkpoints", help="the Checkpointer's folder for the final export")
    main(parser.parse_args())
