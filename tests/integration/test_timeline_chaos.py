"""Seeing the job, end to end: the timeline of a real run with a kill and a join, and
a real run under --chaos-kill-every with its recovery report.

The kill-and-join run is ``make demo``'s: the first agent serves the embedded etcd and
a second agent joins it. Its consoles are what people read, so they are checked too:
the kill is one line per surviving worker (its reform_done), gloo's text goes to the
workers' log files only, and the successful job prints no warning on either console.
"""

from __future__ import annotations

import os
import re
import signal
import struct
import subprocess
import uuid

import pytest

from elastic.cli.timeline import load
from tests.fakes.jobs import ELASTIC_RUN, REPO, Job, wait_until

pytestmark = pytest.mark.timeout(300)


def agent(tmp_path, endpoint, job_id, nproc, script_args, *, name):
    """An agent of the job at ``endpoint``; without one, it serves the embedded etcd."""
    rendezvous = ["--rdzv-endpoint", endpoint, "--job-id", job_id] if endpoint else []
    launcher = [*rendezvous, "--nproc-per-node", str(nproc), "--min-np", "2", "--max-np", "3"]
    return Job(tmp_path, Job.train_args(tmp_path / "out", tmp_path / "logs", launcher, script_args), name=name)


# A console line from a worker: the agent's "[label]: " and one line of a runtime logger.
# A multi-line message (a traceback, gloo's text) would bring lines without the logger.
WORKER_LINE = re.compile(r"^\[rank\d+\]: (elastic|checkpoint|rendezvous): \S")
AGENT_LINE = re.compile(r"^elastic-run: \S"
                        # the end-of-run summary's lines (elastic/timeline/summary.py)
                        r"|^  (\d+ (failure|join|leave|switch)|no failures|timeline: )|^    (at \d+:\d\d  |\.\.\. \d+ more)")
# A warning reaches the console labelled (elastic/contract/console.py), a Python warning as "...Warning:".
WARNING = re.compile(r"\bWARNING\b|\w+Warning: ")


def check_console(text: str) -> list[str]:
    """The console's worker lines, after checking that every line is one readable line."""
    lines = text.splitlines()
    assert all(WORKER_LINE.match(line) or AGENT_LINE.match(line) for line in lines), \
        [line for line in lines if not (WORKER_LINE.match(line) or AGENT_LINE.match(line))][:5]
    assert not [line for line in lines if WARNING.search(line)], [line for line in lines if WARNING.search(line)]
    assert "gloo" not in text and "Traceback" not in text
    return [line for line in lines if line.startswith("[")]


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.mark.slow  # about 24 s; the timeline model and picture are unit-tested: CI runs it; make test stays under 15 min
def test_timeline_of_a_run_with_a_kill_and_a_join(tmp_path):
    # Once shrunk, the ring commits in lockstep without training until it has 3 workers
    # again, so the job cannot end before the joiner (slow to start under load) arrives.
    args = ["--epochs", "1", "--dataset-size", "360", "--step-delay", "0.05", "--hold-below-world", "3"]
    first = agent(tmp_path, None, None, 3, args, name="first")
    found = wait_until(lambda: re.search(r"embedded etcd at (\S+); join with: elastic-run --rdzv-endpoint \S+ --job-id (\S+) ", first.text()),
                       60, "the embedded etcd")
    endpoint, job_id = found.groups()
    first.wait_for_step(8)
    os.kill(first.worker_pid(2), signal.SIGKILL)
    wait_until(lambda: any(e["event"] == "reform_done" for e in first.events()), 60, "the shrink")
    second = agent(tmp_path, endpoint, job_id, 1, args, name="second")
    assert first.wait(240, also=[second]) == 0, first.text()[-3000:]
    assert second.wait(60) == 0, second.text()[-3000:]

    # The kill on the console: one line per surviving worker, its reform_done; what gloo
    # said is in its log file. And no warning anywhere, on either agent's console.
    worker_lines = check_console(first.text())
    check_console(second.text())
    broke = [e for e in first.events() if e["event"] == "reform_done" and e["failed"]]
    broke_in = {e["round"] for e in broke}
    assert len(broke_in) == 1, broke_in
    in_that_round = [line for line in worker_lines if f": round {min(broke_in)}: " in line]
    assert len(in_that_round) == 2, in_that_round
    assert all("reform_done recovered:" in line and "; cause: " in line for line in in_that_round), in_that_round
    assert {line.split("]")[0] for line in in_that_round} == {"[rank0", "[rank1"}, in_that_round
    # The end-of-run summary (elastic/timeline/summary.py) says what the kill and the join cost.
    assert re.search(r"^elastic-run: summary: job \S+ succeeded after \d+ steps in ", first.text(), re.M), first.text()
    assert re.search(r"^  1 failure, 1 join: .* lost \(\d+% of the wall time\)", first.text(), re.M), first.text()
    assert re.search(r"^    at \d+:\d\d  failure: rank 2 killed, [\d.]+ s to train again", first.text(), re.M)
    assert f"  timeline: elastic-run timeline {first.log_dir} -o timeline.png" in first.text()
    for survivor in {e["worker"] for e in broke}:
        log = first.log_dir / f"worker-{survivor}.log"
        assert "elastic: WARNING: ring broken: " in log.read_text(errors="replace"), log

    png = tmp_path / "timeline.png"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")} | {"PYTHONPATH": str(REPO)}
    done = subprocess.run([*ELASTIC_RUN, "timeline", str(first.log_dir), "-o", str(png)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    width, height = png_size(png)
    assert 1000 <= width <= 2000 and 500 <= height <= 2000, (width, height)

    timeline = load(str(first.log_dir))
    [killed] = timeline.failures
    assert killed.kind == "killed" and killed.worker.endswith(".w2")
    assert [c.kind for c in timeline.changes] == ["joined"]
    broke = [r for r in timeline.reformations if r.failed]
    switched = [r for r in timeline.reformations if not r.failed]
    assert broke and broke[0].cause is killed and broke[0].world_size == 2
    assert switched and switched[-1].world_size == 3
    assert [w for _, w in timeline.world][:3] == [3, 2, 3]
    assert len(timeline.lanes) == 4
    # The victim's last second of steps dies with it (elastic/worker/step_log.py): only the others must have steps.
    assert all(lane.steps > 0 for lane in timeline.lanes if lane.worker != killed.worker)
    assert done.stdout.startswith(f"{png}: 3 workers, 1 killed at ")
    assert "1 host joined at" in done.stdout and "succeeded" in done.stdout


@pytest.mark.extended  # a second full job: by hand (`make test-extended`), CI must stay within its time; the report is unit-tested
def test_chaos_kills_a_worker_and_reports_its_recovery(tmp_path):
    # No replacement allowed and min-np 2: the first kill (3 -> 2) is the only one the
    # job survives, so the monkey must kill exactly once and then leave the job alone.
    job = Job(tmp_path, Job.train_args(
        tmp_path / "out", tmp_path / "logs",
        ["--np", "3", "--min-np", "2", "--chaos-kill-every", "2", "--chaos-seed", "7"],
        ["--steps", "250", "--step-delay", "0.03"]))
    assert job.wait(240) == 0, job.text()[-3000:]
    text = job.text()
    kills = [e for e in job.events() if e["event"] == "chaos_kill"]
    assert len(kills) == 1, text[-3000:]
    assert "chaos: 1 kill, 1 recovered; to the next step: median" in text, text[-3000:]
    [row] = re.findall(r"^  1 +[\d.]+  (\S+) \(\d\) +([\d.]+) .* ([\d.]+) +(\d+)  -> (\d+), 2$", text, re.M)
    assert row[0] == kills[0]["worker"]
    exits = [e for e in job.events() if e["event"] == "worker_exited" and e.get("signal") == 9]
    assert [e["worker"] for e in exits] == [kills[0]["worker"]]
    steps = [s["step"] for s in job.steps() if s["rank"] == 0]
    assert max(steps) == 250
