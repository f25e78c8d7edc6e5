"""--backend as a table: what each request gives on hosts with and without enough GPUs."""

from __future__ import annotations

import pytest

from elastic.contract.devices import CPU_AND_CUDA, capability, choose_backend, may_have_cuda, uses_nccl


@pytest.mark.parametrize("requested, cuda, devices, nproc, expected", [
    ("auto", False, 0, 4, "gloo"),  # a CPU host
    ("auto", True, 8, 4, CPU_AND_CUDA),  # one GPU per worker: CPU tensors still work (gloo)
    ("auto", True, 4, 4, CPU_AND_CUDA),
    ("auto", True, 2, 4, "gloo"),  # fewer GPUs than workers: NCCL would refuse a shared GPU
    ("auto", True, 0, 1, "gloo"),  # a CUDA build of torch on a host without a visible GPU
    ("gloo", True, 8, 4, "gloo"),
    ("gloo", False, 0, 4, "gloo"),
    ("nccl", True, 4, 4, "nccl"),
    ("nccl", True, 8, 1, "nccl"),
])
def test_backend_choice(requested, cuda, devices, nproc, expected):
    assert choose_backend(requested, cuda_available=cuda, device_count=devices, nproc_per_node=nproc) == expected


@pytest.mark.parametrize("requested, cuda, devices, nproc, message", [
    ("nccl", False, 0, 1, "--backend nccl needs CUDA"),
    ("nccl", True, 2, 4, "--nproc-per-node 4 but 2 GPU(s) visible"),
    ("mpi", True, 8, 1, "--backend must be auto, gloo or nccl"),
])
def test_a_backend_that_cannot_work_is_one_line(requested, cuda, devices, nproc, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as caught:
        choose_backend(requested, cuda_available=cuda, device_count=devices, nproc_per_node=nproc)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("backend, expected", [
    ("nccl", True), (CPU_AND_CUDA, True), ("cuda:nccl", True), ("gloo", False), ("cpu:gloo", False),
    ("cpu:gloo, cuda:nccl", True), ("mpi", False),
])
def test_uses_nccl_reads_combined_strings(backend, expected):
    assert uses_nccl(backend) is expected


@pytest.mark.parametrize("present, visible, expected", [
    ((), None, False),                                   # a CPU host: torch is never imported
    (("/dev/nvidiactl",), None, True),
    (("/proc/driver/nvidia/version",), None, True),       # driver loaded, device nodes made late
    (("/dev/kfd",), None, True),                          # ROCm: torch.cuda runs there too
    (("/dev/nvidiactl",), "", False),                     # every device hidden
    (("/dev/nvidiactl",), "-1", False),
    (("/dev/nvidiactl",), "0,1", True),
    ((), "0", False),                                     # a variable without a driver
])
def test_may_have_cuda_is_false_only_where_torch_certainly_sees_no_gpu(present, visible, expected):
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert may_have_cuda(exists=lambda path: path in present, environ=environ) is expected


# (backend, model on, host tensors over, CUDA tensors over, the runtime's own tensors on)
@pytest.mark.parametrize("backend, model, host, device, wire", [
    (CPU_AND_CUDA, "cuda", "gloo", "nccl", "cpu"),  # the default on GPU hosts (gpu review G6)
    ("cuda:nccl,cpu:gloo", "cuda", "gloo", "nccl", "cpu"),
    ("nccl", "cuda", None, "nccl", "cuda"),
    ("cuda:nccl", "cuda", None, "nccl", "cuda"),
    ("gloo", "cpu", "gloo", "gloo", "cpu"),  # gloo carries CUDA tensors too, through the host
    ("cpu:gloo", "cpu", "gloo", None, "cpu"),
    ("cpu:gloo,cuda:gloo", "cpu", "gloo", "gloo", "cpu"),
    ("mpi", "cpu", "mpi", "mpi", "cpu"),
    (" CPU:gloo , cuda:NCCL ", "cuda", "gloo", "nccl", "cpu"),
])
def test_what_a_backend_string_carries(backend, model, host, device, wire):
    found = capability(backend)
    assert (found.model_device, found.host_backend, found.device_backend, found.wire_device) == \
        (model, host, device, wire)
    assert uses_nccl(backend) is (device == "nccl" or host == "nccl")


@pytest.mark.parametrize("backend", ["", "foo", "tpu:nccl", "cpu:", "nccl,,gloo"])
def test_a_backend_string_torch_would_refuse_is_one_line(backend):
    with pytest.raises(ValueError, match="is not <backend> or cpu:/cuda:<backend>") as caught:
        capability(backend)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("backend", ["gloo", "nccl", "cpu:gloo,cuda:nccl", "cuda:nccl,cpu:gloo", "mpi", "ucc",
                                     "cpu:gloo", "cuda:nccl"])
def test_the_capabilitys_nccl_and_gloo_say_what_the_strings_tests_said(backend):
    # The worker's ring asks its capability where it used to test the backend string.
    assert capability(backend).nccl == uses_nccl(backend)
    assert capability(backend).gloo == ("gloo" in backend)
