"""A plain torchrun-style script (no elastic API) that reports how it was started.

    python tests/fakes/env_probe.py --out FILE [ARGS...]   (or: -m tests.fakes.env_probe)

It joins the job's process group the torchrun way (env://: MASTER_ADDR, MASTER_PORT,
RANK, WORLD_SIZE), appends one JSON line to FILE with the torchrun variables it was
given, its arguments, its agent's pid and whether it ran as __main__, then waits at a
barrier so that every rank has written before any exits.
"""

import json
import os
import sys

TORCHRUN_VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE",
)


def main() -> None:
    import torch.distributed as dist

    out = sys.argv[sys.argv.index("--out") + 1]
    dist.init_process_group("gloo")
    record = {name: os.environ.get(name) for name in TORCHRUN_VARIABLES}
    record.update(agent_pid=os.getppid(), argv=sys.argv[1:], main=__name__ == "__main__")
    with open(out, "a") as f:  # one short append per line: ranks do not interleave
        f.write(json.dumps(record) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
