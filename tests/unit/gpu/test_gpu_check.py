"""The GPU run's checks on a CPU (CI): the plan fits the GPU host's 8 minutes with the
preflight first, the CUDA checks skip with their reason, and the harness's bounds and
verdicts hold (a hanging check is killed at its budget, a raising one fails, each result
is written as the check ends, the folder holds at most four files)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.gpu import check
from tests.gpu.check_base import Probe

# The fake checks, in a module without torch: each runs in a process of its own, which
# imports it (importing this test file would cost each one torch's import, ~4 s of CPU).
FAKES = "tests.unit.gpu.fake_checks:FAKES"
# gpu-3's section 3C: what a GPU host must settle, by check name.
ON_ONE_GPU = {"preflight", "nccl_peer_loss", "default_backend_e2e", "stale_dump_key", "abort_in_setup", "exit_join",
              "three_agents_kill", "cuda_snapshot_durable", "capture_vs_watch", "sharded_world1", "device_hang",
              "commit_stall"}
GPU = Probe(cuda=True, device_count=1, etcd=None, two_ranks=None)


def test_the_plan_fits_eight_minutes_on_a_gpu_with_the_preflight_first():
    names = [c.name for c in check.CHECKS]
    assert len(names) == len(set(names))
    assert check.PLAN[0] == (check.PREFLIGHT,) and check.phase_preflight(check.PLAN) is check.PREFLIGHT
    on_gpu = [[c for c in phase if check.reason_to_skip(c, GPU) is None] for phase in check.PLAN]
    assert {c.name for phase in on_gpu for c in phase} == ON_ONE_GPU
    # A phase's checks run at once: the run lasts the sum of each phase's longest budget.
    assert sum(max((c.budget_s for c in phase), default=0) for phase in on_gpu) <= check.TOTAL_S
    assert check.TOTAL_S <= 480  # the rest of 8 minutes is the bundle's install (run.sh)


@pytest.mark.parametrize("probe, runs", [
    (Probe(cuda=False, device_count=0, etcd=None), {"preflight", "three_agents_kill_cpu"}),
    (Probe(cuda=False, device_count=0, etcd="not on PATH"), {"preflight"}),
    (Probe(cuda=True, device_count=1, etcd="not on PATH", two_ranks="refused"),
     {"preflight", "stale_dump_key", "abort_in_setup", "exit_join", "cuda_snapshot_durable", "capture_vs_watch",
      "commit_stall"}),
    (GPU, ON_ONE_GPU),
])
def test_which_checks_run_where(probe, runs):
    reasons = {c.name: check.reason_to_skip(c, probe) for c in check.CHECKS}
    assert {name for name, why in reasons.items() if why is None} == runs
    for name, why in reasons.items():
        if name not in runs:
            assert why and any(word in why for word in ("CUDA", "etcd", "NCCL", "named")), (name, why)


def _entries(out):
    return [json.loads(line) for line in (out / "checks.jsonl").read_text().splitlines()]


def test_each_check_gets_its_own_process_and_bound(tmp_path, capsys):
    out = tmp_path / "out"
    rc = check.main(["--registry", FAKES, "--out", str(out), "--workdir", str(tmp_path / "w")])
    printed = [x for x in capsys.readouterr().out.splitlines() if not x.startswith("gpu-check:")]
    assert rc == 1  # a check failed
    by_name = {e["name"]: e for e in _entries(out)}
    assert by_name["passes"]["status"] == "PASS" and by_name["passes"]["figures"] == {"figure": 1.5}
    assert (tmp_path / "w" / "passes" / "made").exists()
    assert by_name["fails"]["status"] == "FAIL" and by_name["fails"]["detail"] == "the thing broke"
    assert by_name["raises"]["status"] == "FAIL" and "ValueError: no such device" in by_name["raises"]["detail"]
    assert by_name["hangs"]["status"] == "FAIL" and "timed out after 3s" in by_name["hangs"]["detail"]
    assert by_name["hangs"]["seconds"] < 10  # the hang cost its budget (3 s), not the run
    if not torch.cuda.is_available():
        assert by_name["on_cuda"]["status"] == "SKIP" and "no CUDA here" in by_name["on_cuda"]["detail"]
    assert [x.split()[:2] for x in printed] == [[by_name[n]["status"], n] for n in by_name]
    assert {p.name for p in out.iterdir()} <= {"checks.jsonl", "summary.json", "logs.tgz", "console.txt"}
    assert json.loads((out / "summary.json").read_text())


def test_a_check_that_no_longer_fits_the_total_is_skipped(tmp_path, capsys):
    rc = check.main(["--registry", FAKES, "--only", "passes,fails", "--total-s", "20",
                     "--out", str(tmp_path / "out"), "--workdir", str(tmp_path / "w")])
    printed = capsys.readouterr().out
    assert rc == 0 and "SKIP passes [X1] its 30s no longer fit in the run's total" in printed


def test_an_unknown_check_name_or_no_out_is_one_line_and_status_2(tmp_path, capsys):
    assert check.main(["--only", "nope", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no check named nope" in err
    assert check.main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out DIR is required" in err
