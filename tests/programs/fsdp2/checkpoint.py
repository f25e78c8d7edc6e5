"""The example's Checkpointer: full (unsharded) state dicts in numbered folders, rank 0 writes.

pytorch/examples' FSDP2 example keeps this module beside its script and imports it as
`from checkpoint import Checkpointer`, the name the runtime's own checkpoint room once
had. Ported to elastic-run, resuming is ShardedState's job (in-memory copies on peers,
then --checkpoint-dir); this export stays: the finished model as one plain file that
any script loads.
"""

import os

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

MODEL_FILE, OPTIM_FILE = "model_state_dict.pt", "optim_state_dict.pt"


def newest_folder(path):
    """The highest numbered folder under `path`, or None."""
    numbers = [int(n) for n in os.listdir(path) if n.isdigit()] if os.path.isdir(path) else []
    return max(numbers, default=None)


class Checkpointer:
    def __init__(self, folder: str):
        self.folder = folder
        self.last_step = newest_folder(folder)

    def save(self, model, optim, step: int):
        """Collective: every rank calls it; rank 0 writes the gathered, CPU-resident dicts."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd = get_model_state_dict(model, options=options)
        optim_sd = get_optimizer_state_dict(model, optim, options=options)
        if torch.distributed.get_rank() != 0:
            return
        target = os.path.join(self.folder, str(step))
        os.makedirs(target, exist_ok=True)
        for name, value in ((MODEL_FILE, model_sd), (OPTIM_FILE, optim_sd)):
            tmp = os.path.join(target, f".{name}.tmp")
            torch.save(value, tmp)
            os.replace(tmp, os.path.join(target, name))
        self.last_step = step
