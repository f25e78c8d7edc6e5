"""A plain torchrun-style script (no elastic API) that reports how it was started.

    python tests/fakes/env_probe.py --out FILE [--die-once MARKER] [ARGS...]
    (or: -m tests.fakes.env_probe ...)

It joins the job's process group the torchrun way (env://: MASTER_ADDR, MASTER_PORT,
RANK, WORLD_SIZE), appends one JSON line to FILE with the torchrun variables it was
given, its arguments, its agent's pid and whether it ran as __main__, then waits at a
barrier so that every rank has written before any exits.

The line also says what a worker forked from its agent's template (a warm start) must
share with a fresh process, and must not share with the worker forked before it: whether
torch was imported before the script ran, torch's thread count, the first draws of torch's,
numpy's and Python's generators, the warnings filters once an optimizer exists, and whether it sees what a worker
changes once its line is written (``sys.path``, ``sys.modules``, warnings, torch's
threads and seed).

With ``--die-once MARKER``, the first rank-1 worker of the job (MARKER does not exist
yet) creates MARKER, appends its line (with ``"died": true``) and SIGKILLs itself before
joining the process group: a crash its agent must answer with a restart.
"""

import json
import os
import random
import signal
import sys
import warnings

WARM = "torch" in sys.modules  # imported before the script ran: forked from a template

# The variables torch's LocalElasticAgent sets for its workers (torch 2.13,
# local_elastic_agent.py _start_workers; LOCAL_RANK included), but for
# TORCH_NCCL_ASYNC_ERROR_HANDLING, which elastic-run sets for NCCL only.
TORCHRUN_VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
)


def option(name: str):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None


def fresh_facts() -> dict:
    import numpy
    import torch

    # As a training script does: the first optimizer imports torch._dynamo (and sympy, whose
    # import adds a warnings filter), which a template has imported already.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    return dict(warm=WARM, threads=torch.get_num_threads(), torch_seed=torch.initial_seed(),
                numpy_draw=int(numpy.random.randint(1 << 30)), random_draw=random.random(),
                filters=len(warnings.filters), cuda=torch.cuda.is_initialized(),
                changed="/changed" in sys.path or "changed_module" in sys.modules)


def change_the_process() -> None:
    import torch

    sys.path.insert(0, "/changed")
    sys.modules["changed_module"] = sys
    warnings.simplefilter("error")
    torch.set_num_threads(3)
    torch.manual_seed(1)


def main() -> None:
    import torch.distributed as dist

    out = option("--out")
    record = {name: os.environ.get(name) for name in TORCHRUN_VARIABLES}
    # The agent, not the parent: a warm worker's parent is its agent's template.
    record.update(agent_pid=int(os.environ["ELASTIC_WORKER_AGENT_PID"]), argv=sys.argv[1:], main=__name__ == "__main__")
    record.update(fresh_facts())
    marker = option("--die-once")
    if marker is not None and os.environ["RANK"] == "1" and not os.path.exists(marker):
        open(marker, "w").close()
        with open(out, "a") as f:
            f.write(json.dumps({**record, "died": True}) + "\n")
        change_the_process()
        os.kill(os.getpid(), signal.SIGKILL)
    dist.init_process_group("gloo")
    with open(out, "a") as f:  # one short append per line: ranks do not interleave
        f.write(json.dumps(record) + "\n")
    change_the_process()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
