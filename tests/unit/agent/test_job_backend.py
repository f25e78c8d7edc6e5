"""One backend per job (gpu review G7): what a later host does with the first host's
choice, as a table (the record in etcd: tests/integration/test_job_backend.py)."""

from __future__ import annotations

import pytest

from elastic.agent.job_backend import agree
from elastic.contract.devices import CPU_AND_CUDA
from elastic.rendezvous import ConfigError


@pytest.mark.parametrize("mine, recorded, expected", [
    (CPU_AND_CUDA, None, CPU_AND_CUDA),  # the first host decides
    ("gloo", None, "gloo"),
    (CPU_AND_CUDA, (CPU_AND_CUDA, "a"), CPU_AND_CUDA),
    ("gloo", ("gloo", "a"), "gloo"),
    ("nccl", ("nccl", "a"), "nccl"),
    # --backend gloo given here (it never resolves to anything else) in a gloo job, whether
    # its first host was given gloo or had no GPU per worker: the user asked for gloo.
    ("gloo", ("gloo", "degraded"), "gloo"),
])
def test_a_host_uses_the_jobs_backend_when_it_can(mine, recorded, expected):
    assert agree(mine, recorded) == expected


@pytest.mark.parametrize("mine, recorded, message", [
    ("gloo", (CPU_AND_CUDA, "a"), "cannot give each of its workers a GPU"),  # a host that lost a GPU
    ("nccl", ("gloo", "a"), "every host of a job must use one backend"),
    ("gloo", ("nccl", "a"), "every host of a job must use one backend"),
    (CPU_AND_CUDA, ("nccl", "a"), "every host of a job must use one backend"),
    # gpu review N9: auto on a GPU host in a job whose first host recorded gloo (it saw no GPU
    # per worker, or was given --backend gloo) is not silently turned into gloo.
    (CPU_AND_CUDA, ("gloo", "a"), "this GPU host would run on gloo, several times slower, unasked"),
])
def test_a_host_that_cannot_is_refused_in_one_line(mine, recorded, message):
    with pytest.raises(ConfigError, match=message) as caught:
        agree(mine, recorded)
    assert "\n" not in str(caught.value) and "chosen by host a" in str(caught.value)


def test_a_gpu_host_in_a_gloo_job_names_both_choices_and_how_to_run_on_gloo():
    with pytest.raises(ConfigError) as caught:
        agree(CPU_AND_CUDA, ("gloo", "gpu07"))
    said = str(caught.value)
    assert said.startswith("--backend: the job runs gloo (chosen by host gpu07) but this host resolved "
                           f"{CPU_AND_CUDA}: ")
    assert said.endswith("fix host gpu07, or give --backend gloo to every host to run the job on gloo")
