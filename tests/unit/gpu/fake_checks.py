"""Fake checks for the gpu-check harness's tests (test_gpu_check.py): one that passes, one
that fails, one that raises, one that hangs past its budget, one that needs CUDA. No torch
here: each check's process imports this module."""

from __future__ import annotations

import time

from tests.gpu.check_base import Check, Outcome


def _passes(ctx):
    (ctx.workdir / "made").write_text("x")
    return Outcome(True, "fine", {"figure": 1.5})


def _fails(ctx):
    return Outcome(False, "the thing broke")


def _raises(ctx):
    raise ValueError("no such device")


def _hangs(ctx):
    time.sleep(600)


FAKES = (
    Check("passes", "X1", 30, _passes, needs=()),
    Check("fails", "X2", 30, _fails, needs=()),
    Check("raises", "X3", 30, _raises, needs=()),
    Check("hangs", "X4", 3, _hangs, needs=()),
    Check("on_cuda", "X5", 30, _passes),
)
