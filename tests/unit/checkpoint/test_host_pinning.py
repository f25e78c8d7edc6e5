"""A refused ``cudaHostRegister`` leaves no CUDA error behind (gpu review gpu-3 N3): the
runtime keeps the refusal as the thread's "last error", which torch's next kernel-launch
check would raise at an unrelated call (an AcceleratorError: a broken process, replaced
again and again). On the CPU with a fake runtime whose last error behaves as CUDA's."""

from __future__ import annotations

import pytest
import torch

from elastic.checkpoint import host_pinning
from elastic.checkpoint import snapshot as snapshot_module


class FakeRuntime:
    """One thread's CUDA runtime: a registration status, and its sticky last error."""

    def __init__(self, status):
        self.status, self.last_error, self.registered = status, 0, []

    def cudaHostRegister(self, pointer, size, flags):
        if self.status == 0:
            self.registered.append((pointer, size))
        else:
            self.last_error = self.status
        return self.status

    def cudaGetLastError(self):  # the loaded libcudart's: reads and clears
        error, self.last_error = self.last_error, 0
        return error


@pytest.fixture(autouse=True)
def _fresh():
    host_pinning.forget_refusal()
    yield
    host_pinning.forget_refusal()


def _register(runtime, clear_with_library=None, clear_with_kernel=None):
    return host_pinning.register(
        torch.zeros(16), cudart=runtime,
        clear_with_library=clear_with_library or runtime.cudaGetLastError,
        clear_with_kernel=clear_with_kernel or (lambda: pytest.fail("the library cleared it")))


def test_a_registration_that_works_pins_the_buffer():
    runtime = FakeRuntime(0)
    assert _register(runtime) is True and runtime.registered and host_pinning.refused() is None


@pytest.mark.parametrize("status", [712, 801])  # already registered; not supported (confidential computing)
def test_a_refusal_clears_the_last_error_and_stops_further_tries(status, caplog):
    runtime = FakeRuntime(status)
    assert _register(runtime) is False
    assert runtime.last_error == 0  # nothing left for the next kernel launch to raise
    assert host_pinning.refused() == f"cudaHostRegister returned {status}"
    runtime.status = 0
    assert _register(runtime) is False and not runtime.registered  # not asked again in this process
    assert caplog.text.count("host memory registration refused") == 1


def test_without_the_runtime_library_a_probe_kernel_clears_it():
    runtime, probes = FakeRuntime(712), []

    def probe():  # torch's launch check reads (and so clears) the last error, and raises it
        probes.append(runtime.cudaGetLastError())
        return "AcceleratorError: host memory already registered"

    assert _register(runtime, clear_with_library=lambda: None, clear_with_kernel=probe) is False
    assert probes == [712] and runtime.last_error == 0


def test_the_runtime_library_is_the_one_torch_loaded(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f0 r-xp 00000000 08:01 1 /opt/torch/lib/libcudart.so.12\n"
        "7f1 r-xp 00000000 08:01 2 /usr/lib/libc.so.6\n"
        "7f2 r--p 00000000 08:01 1 /opt/torch/lib/libcudart.so.12\n")
    assert host_pinning._loaded_cudart_paths(str(maps)) == ["/opt/torch/lib/libcudart.so.12"]
    opened = []

    class Library:
        def cudaGetLastError(self):
            return 712

    def load(path):
        opened.append(path)
        if path == "/gone":
            raise OSError("no such file")
        return Library()

    assert host_pinning.clear_last_error_with_library(["/gone", "/lib/libcudart.so"], load=load) == 712
    assert opened == ["/gone", "/lib/libcudart.so"]
    assert host_pinning.clear_last_error_with_library([], load=load) is None


def test_the_snapshot_pins_through_it_and_falls_back_to_the_pinned_allocator(monkeypatch):
    asked, registered = [], []
    monkeypatch.setattr(host_pinning, "register", lambda buffer: asked.append(buffer.numel()) or True)
    buffer = snapshot_module._host_buffer(8, torch.float32, True, registered)
    assert asked == [8] and registered == [buffer.data_ptr()]
    monkeypatch.setattr(host_pinning, "register", lambda buffer: False)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: ("pinned", self.numel()))
    assert snapshot_module._host_buffer(8, torch.float32, True, registered) == ("pinned", 8)
    assert len(registered) == 1
