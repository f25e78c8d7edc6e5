"""The Lightning program's model and data, in plain torch: the test builds its reference run
from them without importing Lightning (whose import costs seconds of CPU)."""

import torch
from torch.utils.data import TensorDataset


def make_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()


def make_data() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.rand(64, 20, generator=gen, dtype=torch.float64),
                         torch.rand(64, 1, generator=gen, dtype=torch.float64))
