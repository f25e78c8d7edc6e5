"""Recovery with the Horovod API against the native API: SIGKILL of 1 of 4 workers -> next step.

    python -m benchmarks.horovod_recovery [--reps 5] [--state-mb 6] [--json PATH]

Two variants of the same script core (benchmarks/workload.py: model, data, step), both
under ``elastic-run --np 4 --min-np 2 --max-np 4``, committing every step:

  elastic   the native API: elastic.TorchState, @elastic.run, DDP(init_sync=False)
  horovod   ``import elastic.horovod as hvd``: hvd.init, hvd.DistributedOptimizer,
            hvd.elastic.TorchState(model, optimizer), @hvd.elastic.run

Reps alternate between the variants (a drifting load hits both alike). Each rep is
benchmarks/recovery.py's: warm up, SIGKILL a random non-zero rank, measure the time
to the next step completed by any survivor, and the re-formation's phases
(events.jsonl). The Horovod variant should show the same figure within noise: the
recovery path is the runtime's, the API only names it differently.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

from benchmarks import harness, recovery, workload

NPROC = recovery.NPROC
MODULE = "benchmarks.horovod_recovery"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="reps per variant")
    parser.add_argument("--warmup-steps", type=int, default=30)
    parser.add_argument("--recover-timeout", type=float, default=60.0)
    parser.add_argument("--start-timeout", type=float, default=180.0)
    parser.add_argument("--seed", type=int, default=None, help="seed of the random kill points")
    parser.add_argument("--state-mb", type=float, default=6.0, help="state (parameters + momentum) in MB")
    parser.add_argument("--json", help="write the results here")
    return parser.parse_args(argv)


def variant_command(name: str, workdir: Path, state_mb: float) -> list[str]:
    timing = ["--steps", "1000000", "--timing-dir", str(workdir / "timing"), "--state-mb", str(state_mb)]
    if name == "elastic":
        return harness.elastic_command(NPROC, 2, NPROC, workdir / "logs", [*timing, "--commit-every", "1"])
    # horovodrun's spelling of the same job, the script run with -m.
    return [str(harness.BIN / "elastic-run"), "-np", str(NPROC), "--min-num-proc", "2", "--max-num-proc", str(NPROC),
            "--output-filename", str(workdir / "logs"), "python", "-m", MODULE, "--worker", *timing]


def one_rep(name: str, args, rng: random.Random) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench-hvd-{name}-") as tmp:
        workdir = Path(tmp)
        (workdir / "timing").mkdir()
        load = os.getloadavg()[0]
        with harness.Job(variant_command(name, workdir, args.state_mb), harness.benchmark_env(),
                         workdir / "launcher.log") as job:
            kill_time = time.time()  # the kill comes later: events before it are not the recovery's
            result = recovery.kill_and_measure(job, workdir, args, rng, name)
            result["phases"] = recovery.reform_phases(workdir / "logs" / "events.jsonl", kill_time)
            result["state_mb"], result["loadavg_1min"] = args.state_mb, load
            if result.get("error") or not result.get("recovered"):
                result["launcher_log_tail"] = (workdir / "launcher.log").read_text(errors="replace")[-2000:]
        return result


# -- the Horovod-API worker -------------------------------------------------------------
def run_worker(argv) -> None:
    """benchmarks/workload.py's elastic mode, written against ``elastic.horovod``."""
    import torch

    import elastic.horovod as hvd

    args = workload.parse_args(["--mode", "elastic", *argv])
    hvd.init()
    model, data = workload.make_model(args.seed), workload.make_data(args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    workload.add_ballast(model, optimizer, args.state_mb, args.seed)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, step=0)
    log = workload.StepLog(args.timing_dir, hvd.rank())

    @hvd.elastic.run
    def train(state):
        while state.step < args.steps:
            # The model itself: DistributedOptimizer all-reduces the gradients (no DDP).
            workload.train_step(state.model, state.optimizer, data, state.step, hvd.rank(), hvd.size(),
                                args.batch_size)
            state.step += 1
            log.done(state.step)
            state.commit()

    train(state)


def main(argv=None) -> None:
    argv = list(argv) if argv is not None else __import__("sys").argv[1:]
    if argv[:1] == ["--worker"]:
        run_worker(argv[1:])
        return
    args = parse_args(argv)
    rng = random.Random(args.seed)
    results: dict[str, list[dict]] = {"elastic": [], "horovod": []}
    for rep in range(args.reps):
        for name in results:
            started = time.monotonic()
            result = one_rep(name, args, rng)
            results[name].append(result)
            print(f"{name} rep {rep + 1}/{args.reps}: "
                  f"{'did not recover' if not result.get('recovered') else harness.fmt(result['kill_to_next_step_s'])}"
                  f" (step {harness.fmt(result.get('step_s'))}){' ' + result['error'] if result.get('error') else ''}"
                  f" (killed rank {result.get('victim_rank')}; load {result['loadavg_1min']:.1f}; "
                  f"rep took {time.monotonic() - started:.0f}s)", flush=True)
    summaries = [recovery.summarize(name, reps, args.state_mb) for name, reps in results.items()]
    recovery.print_table(summaries)
    if args.json:
        Path(args.json).write_text(json.dumps({"summaries": summaries, "reps": results}, indent=2))


if __name__ == "__main__":
    main()
