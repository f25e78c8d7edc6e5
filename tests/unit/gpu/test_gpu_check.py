"""`make gpu-check` on a CPU (CI): the check list is section 4's, the CUDA checks skip with
their reason and the run exits 0, and the harness's bounds and verdicts hold (a hanging
check is killed at its budget, a raising one fails, the JSON records the versions)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.gpu import check
from tests.gpu.check_base import Probe

# The fake checks, in a module without torch: each runs in a process of its own, which
# imports it (importing this test file would cost each one torch's import, ~4 s of CPU).
FAKES = "tests.unit.gpu.fake_checks:FAKES"
SECTION_4 = {"stale_dump_key", "exit_join", "abort_in_setup", "default_backend_e2e", "sharded_world1",
             "device_hang", "cuda_snapshot_durable", "commit_stall"}


def test_the_check_list_is_section_4_within_8_minutes_on_a_gpu():
    names = [c.name for c in check.CHECKS]
    assert SECTION_4 <= set(names) and len(names) == len(set(names))
    on_gpu = [c for c in check.CHECKS if check.reason_to_skip(c, Probe(True, 1, None)) is None]
    assert {c.name for c in on_gpu} == SECTION_4
    assert sum(c.budget_s for c in on_gpu) <= check.TOTAL_S == 480


@pytest.mark.parametrize("probe, runs", [
    (Probe(cuda=False, device_count=0, etcd=None), {"sharded_world1_cpu"}),
    (Probe(cuda=False, device_count=0, etcd="not on PATH"), set()),
    (Probe(cuda=True, device_count=1, etcd="not on PATH"),
     {"stale_dump_key", "exit_join", "abort_in_setup", "cuda_snapshot_durable", "commit_stall"}),
    (Probe(cuda=True, device_count=1, etcd=None), SECTION_4),
])
def test_which_checks_run_where(probe, runs):
    reasons = {c.name: check.reason_to_skip(c, probe) for c in check.CHECKS}
    assert {name for name, why in reasons.items() if why is None} == runs
    for name, why in reasons.items():
        if name not in runs:
            assert why and ("CUDA" in why or "etcd" in why), (name, why)


def test_without_cuda_every_cuda_check_is_skipped_with_its_reason_and_the_run_exits_0(tmp_path, capsys):
    cuda_checks = [c.name for c in check.CHECKS if "cuda" in c.needs]
    out = tmp_path / "check.json"
    rc = check.main(["--only", ",".join(cuda_checks), "--json", str(out), "--workdir", str(tmp_path / "w")])
    printed = capsys.readouterr().out.splitlines()
    if torch.cuda.is_available():
        pytest.skip("CUDA here: the checks would run")
    assert rc == 0
    lines = [x for x in printed if not x.startswith("gpu-check:")]
    assert len(lines) == len(cuda_checks)
    assert all(x.startswith("SKIP ") and "no CUDA here" in x for x in lines), lines
    report = json.loads(out.read_text())
    assert report["versions"]["torch"] == torch.__version__ and "driver" in report["versions"]
    assert [e["name"] for e in report["checks"]] == cuda_checks
    assert all(e["status"] == "SKIP" and e["detail"] for e in report["checks"])


def test_each_check_gets_its_own_process_and_bound(tmp_path, capsys):
    out = tmp_path / "check.json"
    rc = check.main(["--registry", FAKES, "--json", str(out), "--workdir", str(tmp_path / "w")])
    printed = [x for x in capsys.readouterr().out.splitlines() if not x.startswith("gpu-check:")]
    assert rc == 1  # a check failed
    by_name = {e["name"]: e for e in json.loads(out.read_text())["checks"]}
    assert by_name["passes"]["status"] == "PASS" and by_name["passes"]["figures"] == {"figure": 1.5}
    assert (tmp_path / "w" / "passes" / "made").exists()
    assert by_name["fails"]["status"] == "FAIL" and by_name["fails"]["detail"] == "the thing broke"
    assert by_name["raises"]["status"] == "FAIL" and "ValueError: no such device" in by_name["raises"]["detail"]
    assert by_name["hangs"]["status"] == "FAIL" and "timed out after 3s" in by_name["hangs"]["detail"]
    assert by_name["hangs"]["seconds"] < 10  # the hang cost its budget (3 s), not the run
    if not torch.cuda.is_available():
        assert by_name["on_cuda"]["status"] == "SKIP"
    assert [x.split()[:2] for x in printed] == [[by_name[n]["status"], n] for n in by_name]


def test_a_check_that_no_longer_fits_the_total_is_skipped(tmp_path, capsys):
    rc = check.main(["--registry", FAKES, "--only", "passes,fails", "--total-s", "20",
                     "--json", str(tmp_path / "c.json"), "--workdir", str(tmp_path / "w")])
    printed = capsys.readouterr().out
    assert rc == 0 and "SKIP passes [X1] its 30s no longer fit in the run's 20s" in printed


def test_an_unknown_check_name_is_one_line_and_status_2(tmp_path, capsys):
    assert check.main(["--only", "nope", "--json", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no check named nope" in err
