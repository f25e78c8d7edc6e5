"""A training loop with a progress bar as tqdm draws it: ``\\r`` and the bar, redrawn on one line.

Every rank draws its bar; it says ``elastic.report(total_steps=...)``. With --hold-at,
every rank waits (bounded) before that step until --release exists, its bar's line
still open: a test looks at the console and at ``elastic-run status`` meanwhile.
"""

import argparse
import os
import sys
import time

import elastic

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=30)
p.add_argument("--step-delay", type=float, default=0.05)
p.add_argument("--hold-at", type=int, default=None)
p.add_argument("--release", default=None)
args = p.parse_args()

elastic.init()
elastic.report(total_steps=args.steps)
state = elastic.State(step=0)


@elastic.run
def train(state):
    while state.step < args.steps:
        if state.step == args.hold_at:
            deadline = time.monotonic() + 120
            while not os.path.exists(args.release) and time.monotonic() < deadline:
                time.sleep(0.05)
        time.sleep(args.step_delay)
        state.step += 1
        state.commit()
        sys.stdout.write(f"\rtraining: {state.step}/{args.steps} steps")
        sys.stdout.flush()


train(state)
sys.stdout.write("\n")
