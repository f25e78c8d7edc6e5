"""A Hugging Face Trainer script as people write them (run_clm.py's resume pattern), torchrun-style.

A tiny GPT-2 built from a config (nothing downloaded) learns a synthetic token data set.
Like transformers' own example scripts, it resumes from the newest checkpoint in
--output_dir when there is one (`get_last_checkpoint`), so that under torchrun's
semantics (every worker restarted after a failure) a restarted job goes on from its last
`save_steps`. Written for CPUs (gloo) and float64, so a resumed run can be compared with
an uninterrupted one; nothing in it knows elastic-run.

    elastic-run --np 2 --max-restarts 3 train.py --output_dir /shared/run --max_steps 100
"""

import argparse
import os

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint


class Tokens(Dataset):
    """`size` random sequences of `length` tokens, the same in every process."""

    def __init__(self, size, length, vocab, seed=0):
        self.rows = torch.randint(0, vocab, (size, length), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, default=12)
    parser.add_argument("--save_steps", type=int, default=4)
    parser.add_argument("--batch_size", type=int, default=4)
    args = parser.parse_args()

    config = GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).to(torch.float64)
    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=2, logging_steps=1,
        save_strategy="steps", save_steps=args.save_steps, seed=0, report_to=[], use_cpu=True,
        ddp_backend="gloo", dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=training_args, train_dataset=Tokens(256, 12, config.vocab_size))
    last = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    if last is not None:
        print(f"resuming from {last}", flush=True)
    trainer.train(resume_from_checkpoint=last)
    trainer.save_model(os.path.join(args.output_dir, "final"))  # collective: every rank calls it


if __name__ == "__main__":
    main()
