"""--backend on hosts with and without GPUs (torch.cuda faked), and the one-line refusal."""

from __future__ import annotations

import pytest
import torch

from elastic.cli import launch as cli
from elastic.contract.devices import CPU_AND_CUDA


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


def _gpus(monkeypatch, count):
    # A host with GPUs has their driver (the launcher asks torch only then: devices.py).
    monkeypatch.setattr(cli, "may_have_cuda", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize("gpus, argv, expected", [
    (0, ["--np", "2"], "gloo"),
    (8, ["--np", "4"], CPU_AND_CUDA),
    (2, ["--np", "4"], "gloo"),  # more workers than GPUs: auto stays on gloo
    (4, ["--np", "4", "--backend", "nccl"], "nccl"),
    (8, ["--np", "4", "--backend", "gloo"], "gloo"),
])
def test_backend_from_the_host_gpus(monkeypatch, script, gpus, argv, expected):
    _gpus(monkeypatch, gpus)
    config, _ = cli.parse([*argv, script])
    assert config.backend == expected


@pytest.mark.parametrize("gpus, np_", [(0, "1"), (2, "4")])
def test_nccl_without_a_gpu_per_worker_fails_before_start_with_one_line(monkeypatch, script, capsys, gpus, np_):
    _gpus(monkeypatch, gpus)
    assert cli.main(["--np", np_, "--backend", "nccl", script]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("elastic-run: error: --backend nccl "), err
