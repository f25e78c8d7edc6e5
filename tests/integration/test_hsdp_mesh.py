"""Does torch's own HSDP train on CPUs with gloo, in float64, like one process? (No elastic here.)

Four processes, one gloo process group, as a ring of a round is. From it, three meshes:
``init_device_mesh("cpu", (2, 2), ("replicate", "shard"))``; the same 2 x 2 mesh assembled
with ``DeviceMesh.from_group`` from one ``new_group`` per line of each dimension (how
``elastic/sharded/hybrid_mesh.py`` cuts a round's ring); and a 3-D (2, 1, 2) mesh
("replicate", "shard", "tp") with 2-way tensor parallelism inside each group. On each,
``fully_shard`` a model of four FSDP units and train it with AdamW, a StepLR and
gradient clipping; the full parameters must equal a single process's within 1e-12
(measured: 5.6e-17 on each, torch 2.13).

Found on the way (torch 2.13): ``clip_grad_norm_`` fails ("All operands in aten.stack
must have the same mesh") when some parameters are on the 3-D mesh and others only on
its ("replicate", "shard") part; so every Linear is tensor-parallel here.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.fakes.jobs import REPO

pytestmark = pytest.mark.timeout(240)

PROGRAM = textwrap.dedent('''
    import os, sys, torch, torch.nn as nn, torch.distributed as dist
    import torch.multiprocessing as mp
    torch.set_default_dtype(torch.float64)
    STEPS, GB = 6, 24

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(7, 10), nn.Linear(10, 13), nn.Linear(13, 3)
        def forward(self, x):
            return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))

    def build():
        torch.manual_seed(0)
        return Net()

    gen = torch.Generator().manual_seed(1234)
    X, Y = torch.randn(STEPS * GB, 7, generator=gen), torch.randn(STEPS * GB, 3, generator=gen)

    def train(model, index, count):
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        sch = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
        for step in range(STEPS):
            rows = torch.arange(step * GB, (step + 1) * GB)[index::count]
            (((model(X[rows]) - Y[rows]) ** 2).sum() * count / GB).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
            opt.step(); opt.zero_grad(); sch.step()
        return model

    def lines_mesh(shape, names, rank):
        from torch.distributed.device_mesh import DeviceMesh
        ranks = torch.arange(4).view(shape)
        mine = []
        for dim in range(ranks.dim()):
            found = None
            for line in ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist():
                group = dist.new_group(line)
                found = group if rank in line else found
            mine.append(found)
        return DeviceMesh.from_group(mine, "cpu", mesh=ranks, mesh_dim_names=names)

    def worker(rank, port, out):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=4)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        results = {}
        for how in ("init_device_mesh", "from_group", "tp"):
            if how == "init_device_mesh":
                mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            elif how == "from_group":
                mesh = lines_mesh((2, 2), ("replicate", "shard"), rank)
            else:
                mesh = lines_mesh((2, 1, 2), ("replicate", "shard", "tp"), rank)
            with torch.device("meta"):
                model = build()
            dp = mesh
            if how == "tp":
                parallelize_module(model, mesh["tp"], {"a": ColwiseParallel(), "b": RowwiseParallel(),
                                                       "c": ColwiseParallel(output_layouts=Replicate())})
                dp = mesh["replicate", "shard"]
            for layer in (model.a, model.b, model.c):
                fully_shard(layer, mesh=dp)
            fully_shard(model, mesh=dp)
            model.to_empty(device="cpu")
            set_model_state_dict(model, build().state_dict(), options=StateDictOptions(full_state_dict=True))
            index, count = (rank // 2, 2) if how == "tp" else (rank, 4)
            train(model, index, count)
            results[how] = {k: v.full_tensor() for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save(results, out)
        dist.destroy_process_group()

    if __name__ == "__main__":
        port, out = int(sys.argv[1]), sys.argv[2]
        reference = train(build(), 0, 1).state_dict()
        mp.spawn(worker, args=(port, out), nprocs=4)
        results = torch.load(out)
        for how, got in results.items():
            print(how, max((got[k] - reference[k]).abs().max().item() for k in reference))
''')


@pytest.mark.slow  # four processes of torch: the hybrid tests prove the same through elastic-run
def test_hsdp_over_gloo_in_float64_equals_one_process_on_three_meshes(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    program = tmp_path / "hsdp.py"
    program.write_text(PROGRAM)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTIC_", "MASTER_", "RANK", "WORLD_"))}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, str(program), str(port), str(tmp_path / "out.pt")], env=env,
                          capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stderr[-3000:]
    errors = dict(line.split() for line in done.stdout.splitlines() if line.split()[0] in
                  ("init_device_mesh", "from_group", "tp"))
    assert set(errors) == {"init_device_mesh", "from_group", "tp"}, done.stdout
    for how, error in errors.items():
        assert float(error) <= 1e-12, (how, error)
    assert torch.load(tmp_path / "out.pt", weights_only=True)["tp"]["a.weight"].dtype == torch.float64
