"""A script folder with modules of its own named like the runtime's rooms still runs.

pytorch/examples' FSDP2 example keeps a ``checkpoint.py`` beside its script (``from
checkpoint import Checkpointer``). The script's folder is first on ``sys.path`` in every
worker, so a runtime that installed a top-level ``checkpoint`` or ``rendezvous`` would
import the user's file instead of its own and every worker would die at start. Here the
rooms install as ``elastic.checkpoint`` and ``elastic.rendezvous``; these runs prove it
with real workers and real all-reduces, elastic and torchrun-style, from the script's own
folder and without PYTHONPATH (as a user runs it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.fakes.jobs import ELASTIC_RUN

pytestmark = pytest.mark.timeout(180)

# The user's own modules: each would break the runtime if it were imported in place of one
# of its rooms (they hold none of the names the runtime imports).
OWN_MODULES = ("checkpoint", "rendezvous", "agent", "worker", "state", "contract", "sampler")

ELASTIC_SCRIPT = """
    import json, sys
    import torch, torch.distributed as dist
    import checkpoint, rendezvous, agent, worker, state, contract, sampler
    from checkpoint import Checkpointer
    import elastic

    mine = [m.ORIGIN for m in (checkpoint, rendezvous, agent, worker, state, contract, sampler)]
    elastic.init()
    st = elastic.TorchState(total=torch.zeros(1, dtype=torch.float64), steps=0)

    @elastic.run
    def train(st):
        while st.steps < 5:
            value = torch.tensor([float(elastic.rank() + 1)], dtype=torch.float64)
            dist.all_reduce(value)
            st.total += value
            st.steps += 1
            st.commit()

    train(st)
    with open(f"{sys.argv[1]}/rank{elastic.rank()}.json", "w") as f:
        json.dump({"modules": mine, "total": st.total.item(), "ckpt": Checkpointer.__module__}, f)
"""

TORCHRUN_SCRIPT = """
    import json, os, sys
    import torch, torch.distributed as dist
    import checkpoint, rendezvous, agent, worker, state, contract, sampler

    mine = [m.ORIGIN for m in (checkpoint, rendezvous, agent, worker, state, contract, sampler)]
    dist.init_process_group("gloo")
    value = torch.tensor([float(dist.get_rank() + 1)], dtype=torch.float64)
    dist.all_reduce(value)
    with open(f"{sys.argv[1]}/rank{dist.get_rank()}.json", "w") as f:
        json.dump({"modules": mine, "total": value.item()}, f)
    dist.destroy_process_group()
"""


def _script_folder(tmp_path, script: str):
    folder = tmp_path / "project"
    folder.mkdir()
    for name in OWN_MODULES:
        extra = "class Checkpointer:\n    pass\n" if name == "checkpoint" else ""
        (folder / f"{name}.py").write_text(f"ORIGIN = 'user'\n{extra}")
    (folder / "train.py").write_text(textwrap.dedent(script))
    out = tmp_path / "out"
    out.mkdir()
    return folder, out


@pytest.mark.parametrize("script, expected_total", [
    (ELASTIC_SCRIPT, 5 * 3.0),      # 5 steps of 1 + 2
    (TORCHRUN_SCRIPT, 3.0),
], ids=["elastic", "torchrun-style"])
def test_a_script_with_its_own_checkpoint_and_rendezvous_modules_runs(tmp_path, script, expected_total):
    folder, out = _script_folder(tmp_path, script)
    # As a user runs it: from the script's folder, nothing on PYTHONPATH; the runtime comes
    # from the installed package.
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_") and k != "PYTHONPATH"}
    done = subprocess.run([*ELASTIC_RUN, "--np", "2", "train.py", str(out)], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for result in results:
        assert result["modules"] == ["user"] * len(OWN_MODULES)
        assert result["total"] == expected_total
    if script is ELASTIC_SCRIPT:
        assert results[0]["ckpt"] == "checkpoint"


def test_the_runtime_imports_its_rooms_under_the_elastic_namespace_only():
    # The launcher's own imports, in a fresh interpreter: no top-level rendezvous or
    # checkpoint module is ever loaded (a user's would be, from the script's folder).
    probe = ("import sys, elastic.cli, elastic.agent, elastic.checkpoint, elastic.rendezvous, elastic.worker.session;"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('rendezvous', 'checkpoint')))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", probe], cwd="/", env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
