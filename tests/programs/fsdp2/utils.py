"""Checks that the model is what FSDP2 should have made of it (as the example's utils.py)."""

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import Shard

from model import Transformer


def inspect_model(model, dtype=torch.float32):
    if not (isinstance(model, Transformer) and isinstance(model, FSDPModule)):
        raise TypeError(f"expected a fully_shard-ed Transformer, got {type(model).__name__}")
    for name, param in model.named_parameters():
        if param.placements != (Shard(0),) or param.dtype != dtype:
            raise TypeError(f"{name}: {param.placements} {param.dtype}, expected (Shard(0),) {dtype}")
