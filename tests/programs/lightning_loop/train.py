"""A PyTorch Lightning program with Lightning's own checkpoints, torchrun-style.

`Trainer(strategy="ddp")` takes its ranks from the variables torchrun (and elastic-run) set;
`devices` and `num_nodes` come from the same environment, as
docs/porting/from-lightning-accelerate-hf.md shows. A `ModelCheckpoint` saves every
--save-every steps with `save_last=True`, and every start resumes with
`trainer.fit(ckpt_path="last")`. A tiny float64 MLP on seeded data and a per-step LR
schedule, so that a resumed run can be compared with a plain one. With the defaults the
checkpoints fall at epoch ends (64 rows, 2 workers of 8: 4 steps an epoch), where a plain
DataLoader resumes exactly.

    elastic-run --np 2 --max-restarts 3 train.py --checkpoints /shared/ckpt --out /shared/final.pt
"""

import argparse
import json
import os
import time

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from model import make_data, make_net  # beside this script


class Regression(pl.LightningModule):
    def __init__(self, steps_log: str, step_delay: float):
        super().__init__()
        self.net = make_net()
        self.steps_log, self.step_delay = steps_log, step_delay

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.trainer.is_global_zero:  # the learning rate this step trains with
            with open(self.steps_log, "a") as f:
                f.write(json.dumps({"step": self.global_step + 1,
                                    "lr": self.trainer.optimizers[0].param_groups[0]["lr"]}) + "\n")
        time.sleep(self.step_delay)
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoints", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--step-delay", type=float, default=0.0)
    args = parser.parse_args()

    # Lightning checks WORLD_SIZE == devices * num_nodes: both from the launcher's environment.
    devices = int(os.environ["LOCAL_WORLD_SIZE"])
    num_nodes = int(os.environ["WORLD_SIZE"]) // devices
    checkpoint = ModelCheckpoint(dirpath=args.checkpoints, every_n_train_steps=args.save_every, save_last=True,
                                 save_top_k=-1)
    trainer = pl.Trainer(accelerator="cpu", strategy=pl.strategies.DDPStrategy(process_group_backend="gloo"),
                         devices=devices, num_nodes=num_nodes, max_steps=args.max_steps, callbacks=[checkpoint],
                         logger=False, enable_progress_bar=False, enable_model_summary=False)
    model = Regression(args.out + ".steps.jsonl", args.step_delay)
    # shuffle=False: Lightning gives each rank a DistributedSampler without shuffling.
    loader = DataLoader(make_data(), batch_size=args.batch_size, shuffle=False)
    trainer.fit(model, train_dataloaders=loader, ckpt_path="last")  # no last.ckpt yet: from the start
    if trainer.is_global_zero:
        torch.save(model.net.state_dict(), args.out)


if __name__ == "__main__":
    main()
