"""The tutorial's toy data set: random (input, target) pairs, made once and kept in memory.

Unlike the tutorial's, it is drawn from a seeded generator in float64, so that every
worker (and a restarted one) holds the same rows and a run can be compared with a
plain one.
"""

import torch
from torch.utils.data import Dataset


class RandomPairs(Dataset):
    def __init__(self, size: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.inputs = torch.rand(size, 20, generator=gen, dtype=torch.float64)
        self.targets = torch.rand(size, 1, generator=gen, dtype=torch.float64)

    def __len__(self):
        return len(self.inputs)

    def __getitem__(self, index):
        return self.inputs[index], self.targets[index]
