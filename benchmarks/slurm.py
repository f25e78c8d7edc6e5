"""Under a real Slurm: time from sbatch to the first step, and from a node's death to the survivors' next step.

    python -m benchmarks.slurm [--reps 2] [--ttl 3] [--json PATH]

Builds the test bed of tests/slurm/ (tests/fakes/slurm_cluster.py: slurmctld and one
slurmd per namespaced host; root, `ip` and Debian's slurm-wlm + munge, installed when
missing). Per rep: `sbatch --nodes=3 deploy/slurm/elastic-run.sbatch` of
tests/fakes/train_job.py (min-np 2, one worker per node, rendezvous and job id from
Slurm), then

- `sbatch -> first step`: the first step any worker records, after sbatch returned;
- `node death -> next step` (goal: --rdzv-ttl + 2 s): at step 10 the last node's
  slurmd and every process on it get SIGKILL; the first step the survivors record in
  their new world of 2 after that.

The killed node's slurmd is started again before the next rep.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from tests.fakes import netns
from tests.fakes.slurm_cluster import SlurmCluster, SlurmJob, ensure_installed
from tests.fakes.waiting import poll


def one_rep(cluster: SlurmCluster, tmp: Path, ttl: float) -> dict:
    stop = tmp / "stop"
    job = SlurmJob(cluster, tmp, "3", ["--min-np", "2", "--max-np", "3", "--rdzv-ttl", str(ttl),
                                       "tests/fakes/train_job.py", "--out", str(tmp / "out"), "--steps", "100000",
                                       "--step-delay", "0.05", "--stop-file", str(stop)])
    job.wait_for_step(1)
    first_step = min(s["t"] for s in job.steps()) - job.submitted
    job.wait_for_step(10)
    victim = next(h for h in cluster.hosts if h.name == job.nodes()[-1])  # not the first node: it serves etcd
    killed_at = time.time()
    cluster.kill_node(victim)
    if not poll(lambda: any(s["world"] == 2 for s in job.steps()), 120, 0.05):
        raise RuntimeError(f"the survivors did not go on:\n{job.text()[-3000:]}")
    next_step = min(s["t"] for s in job.steps() if s["world"] == 2) - killed_at
    stop.touch()
    state = job.wait(300)
    cluster.resume_node(victim)
    return {"sbatch_to_first_step_s": round(first_step, 3), "node_death_to_next_step_s": round(next_step, 3),
            "job_state": state}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--ttl", type=float, default=3.0, help="--rdzv-ttl of the job")
    parser.add_argument("--json", help="write the reps here")
    args = parser.parse_args()
    netns.check_available()
    ensure_installed()
    netns.sweep_leftovers()
    with tempfile.TemporaryDirectory(prefix="bench-slurm-") as work:
        cluster = SlurmCluster(3, Path(work) / "cluster")
        try:
            reps = [one_rep(cluster, Path(work) / f"rep{i}", args.ttl) for i in range(args.reps)]
        finally:
            cluster.destroy()
    print(f"{'rep':>4} {'sbatch -> first step':>22} {'node death -> next step':>24}  job")
    for i, rep in enumerate(reps):
        print(f"{i:>4} {rep['sbatch_to_first_step_s']:>20.2f} s {rep['node_death_to_next_step_s']:>22.2f} s  "
              f"{rep['job_state']}")
    first = statistics.median(r["sbatch_to_first_step_s"] for r in reps)
    death = statistics.median(r["node_death_to_next_step_s"] for r in reps)
    print(f"median: sbatch -> first step {first:.2f} s; node death -> next step {death:.2f} s "
          f"(goal: --rdzv-ttl {args.ttl:g} + 2 = {args.ttl + 2:g} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"ttl": args.ttl, "reps": reps}, indent=2) + "\n")


if __name__ == "__main__":
    main()
