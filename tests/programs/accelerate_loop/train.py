"""An accelerate training loop with accelerate's own checkpoints, torchrun-style.

`Accelerator()` takes its ranks from the variables torchrun (and elastic-run) set; the loop
saves `accelerator.save_state` every --save-every steps (into a temporary folder that rank
0 renames once every rank has written, so a failure mid-save leaves the previous one) and,
at start, resumes from the newest one with `load_state` and `skip_first_batches`, as
docs/porting/from-lightning-accelerate-hf.md shows. float64 and seeded data, so that a
resumed run can be compared with a plain one.

    elastic-run --np 2 --max-restarts 3 train.py --checkpoints /shared/ckpt --out /shared/final.pt
"""

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


def resume(accelerator, train_loader, checkpoint_dir: str, steps_per_epoch: int):
    """Load the newest accelerate state; the loader for the rest of its epoch, and the step."""
    if not os.path.isdir(checkpoint_dir) or not [n for n in os.listdir(checkpoint_dir) if n.isdigit()]:
        return train_loader, 0
    newest = max((n for n in os.listdir(checkpoint_dir) if n.isdigit()), key=int)  # folders named by step
    accelerator.load_state(os.path.join(checkpoint_dir, newest))
    step = int(newest)
    skipped = accelerator.skip_first_batches(train_loader, step % steps_per_epoch)
    return skipped, step


def save(accelerator, checkpoint_dir: str, step: int):
    tmp = os.path.join(checkpoint_dir, f"tmp-{step}")
    accelerator.save_state(tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        os.replace(tmp, os.path.join(checkpoint_dir, str(step)))
    accelerator.wait_for_everyone()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoints", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--save-every", type=int, default=8)
    parser.add_argument("--step-delay", type=float, default=0.0)
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True)
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.rand(256, 20, generator=gen, dtype=torch.float64),
                         torch.rand(256, 1, generator=gen, dtype=torch.float64))
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=False)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    os.makedirs(args.checkpoints, exist_ok=True)

    steps_per_epoch = len(loader)
    first_loader, step = resume(accelerator, loader, args.checkpoints, steps_per_epoch)
    if step:
        accelerator.print(f"resumed at step {step}")
    while step < args.epochs * steps_per_epoch:
        for x, y in (first_loader if step % steps_per_epoch else loader):
            lr = scheduler.get_last_lr()[0]
            optimizer.zero_grad()
            accelerator.backward(F.mse_loss(model(x), y))
            optimizer.step()
            scheduler.step()
            step += 1
            if accelerator.is_main_process:
                with open(os.path.join(args.out + ".steps.jsonl"), "a") as f:
                    f.write(json.dumps({"step": step, "lr": lr}) + "\n")
            time.sleep(args.step_delay)
            if step % args.save_every == 0:
                save(accelerator, args.checkpoints, step)
        first_loader = loader
    if accelerator.is_main_process:
        torch.save(accelerator.unwrap_model(model).state_dict(), args.out)


if __name__ == "__main__":
    main()
