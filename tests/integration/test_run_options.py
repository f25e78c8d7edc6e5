"""elastic-run's promises end to end, each with real elastic-run processes on real etcd:
--max-restarts, --rdzv-timeout, two jobs on one etcd, torchrun's variables, -m MODULE,
bad ELASTIC_* values, and an agent with its workers over TLS with a password."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path

import grpc
import pytest
import torch
from etcd3 import etcdrpc

from elastic.rendezvous import JobKeys, RoundPlan
from elastic.rendezvous.etcd import Etcd
from tests.fakes.jobs import ELASTIC_RUN, REPO, Job, read_jsonl, wait_until
from tests.fakes.pki import make_pki, tls_etcd_server

from ..conftest import etcd_binary_or_skip

pytestmark = pytest.mark.timeout(300)
heavy = pytest.mark.slow  # several real jobs each: the slow run, which CI runs too

ENV_PROBE = REPO / "tests" / "fakes" / "env_probe.py"


def new_job_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:10]}"


def train(tmp: Path, launcher: list[str], script_args: list[str], *, name: str = "job") -> Job:
    return Job(tmp, Job.train_args(tmp / "out", tmp / "logs", launcher, script_args), name=name)


def finals(out: Path) -> list[dict]:
    return [torch.load(p, weights_only=True) for p in sorted(out.glob("final-*.pt"))]


def assert_identical(params: list[dict]) -> None:
    assert params, "no worker wrote its final parameters"
    for other in params[1:]:
        for name, value in params[0].items():
            assert torch.equal(value, other[name]), name


def events_named(job: Job, name: str) -> list[dict]:
    return [e for e in job.events() if e["event"] == name]


def agent_lines(text: str) -> list[str]:
    """The agent's own lines (worker output is prefixed with [rankN] or [worker id])."""
    return [line for line in text.splitlines() if line.startswith("elastic-run:")]


# ----------------------------------------------------------------------------- --max-restarts


@heavy
def test_a_spent_max_restarts_budget_replaces_no_more_and_the_job_goes_on(tmp_path):
    """--max-restarts 1: the first kill is replaced, the second is not; with --min-np 2
    the job goes on with two workers and ends well. (One job for what two parametrized
    jobs asserted before: a loss replaced within the budget, and one past it.)"""
    stop = tmp_path / "stop"
    job = train(tmp_path, ["--np", "3", "--min-np", "2", "--max-restarts", "1", "--collective-timeout", "20"],
                ["--steps", "1000000", "--step-delay", "0.03", "--stop-file", str(stop)])
    job.wait_for_step(10)
    first = job.worker_pid(1)
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: [s for s in job.steps() if s["world"] == 2], 120, "the ring of two")
    # The replacement joins: the ring of 3 trains again.
    wait_until(lambda: len(events_named(job, "worker_started")) == 4
               and job.steps()[-1]["world"] == 3, 180, "the replacement to train in a ring of 3")
    second = job.worker_pid(2)
    killed_at = time.time()
    os.kill(second, signal.SIGKILL)
    wait_until(lambda: len([s for s in job.steps() if s["world"] == 2 and s["t"] > killed_at]) >= 20, 120,
               "20 steps of the two left")
    stop.touch()
    assert job.wait(120) == 0, job.text()[-3000:]
    started = events_named(job, "worker_started")
    assert len(started) == 4, started  # three, and one replacement: the budget was spent
    victims = {e["worker"] for e in started if e["pid"] in (first, second)}
    assert {e["worker"] for e in events_named(job, "worker_exited") if e["signal"] == signal.SIGKILL} == victims
    # The replacement was a new process started for a later round (within the budget, as
    # with --max-restarts 1 from the start); the second loss, with none left, was not
    # replaced (as with --max-restarts 0): 3, then 2, 3 again, and 2 to the end.
    assert started[-1]["round"] > 1 and started[-1]["pid"] != first
    worlds = [e["world_size"] for e in sorted(events_named(job, "round_formed"), key=lambda e: e["round"])]
    assert worlds[:2] == [3, 2] and 3 in worlds[2:] and worlds[-1] == 2, worlds
    assert len(finals(job.out)) == 2
    assert_identical(finals(job.out))


def test_below_min_np_with_no_restarts_left_the_job_fails_with_one_line(tmp_path):
    job = train(tmp_path, ["--np", "2", "--min-np", "2", "--max-restarts", "0", "--rdzv-timeout", "5",
                           "--collective-timeout", "20"],
                ["--steps", "100000", "--step-delay", "0.03"])
    job.wait_for_step(5)
    os.kill(job.worker_pid(1), signal.SIGKILL)
    assert job.wait(120) == 1, job.text()[-3000:]
    failed = [line for line in agent_lines(job.text()) if " failed: " in line and line.startswith("elastic-run: job ")]
    assert len(failed) == 1, job.text()[-3000:]
    assert "only 1 of min_np=2 workers present after waiting 5s" in failed[0], failed
    assert "Traceback" not in "\n".join(agent_lines(job.text()))


# ----------------------------------------------------------------------------- --rdzv-timeout


def test_rdzv_timeout_fails_a_job_short_of_min_np_with_one_line_naming_the_count(tmp_path, etcd_server):
    job_id = new_job_id("rdzv-timeout")
    started = time.monotonic()
    job = Job(tmp_path, ["--rdzv-endpoint", etcd_server.endpoint, "--job-id", job_id,
                         "--host-addr", "127.0.0.1", "--nproc-per-node", "2", "--min-np", "3", "--max-np", "3",
                         "--rdzv-timeout", "6", "--log-dir", str(tmp_path / "logs"), str(ENV_PROBE),
                         "--out", str(tmp_path / "env.jsonl")])
    assert job.wait(120) == 1, job.text()[-3000:]
    elapsed = time.monotonic() - started
    assert elapsed >= 6, elapsed  # it waited the timeout out, from the agent's registration
    failed = [line for line in agent_lines(job.text()) if line.startswith(f"elastic-run: job {job_id} ")]
    assert failed == [f"elastic-run: job {job_id} failed: only 2 of min_np=3 workers present after waiting 6s"], \
        job.text()[-3000:]
    assert not events_named(job, "worker_started")  # no round, so no worker ever ran
    assert "Traceback" not in job.text()
    # Meanwhile the console said how long it would wait: at once, then every few seconds.
    waiting = [int(m.group(1)) for m in re.finditer(r"waiting for workers: 2 of 3 present, failing in (\d+) s",
                                                    job.text())]
    assert len(waiting) >= 2 and waiting[0] <= 6 and waiting == sorted(set(waiting), reverse=True), job.text()[-3000:]


def test_every_agent_prints_the_waiting_line_not_only_the_coordinator(tmp_path, etcd_server, etcd):
    """Two agents, 3 workers, --min-np 4: the coordinator counts, the other agent's
    console shows the same countdown (from the coordinator's notice in etcd)."""
    job_id = new_job_id("waiting")
    jobs = []
    for name, workers in (("first", "2"), ("second", "1")):
        home = tmp_path / name
        home.mkdir()
        jobs.append(Job(home, ["--rdzv-endpoint", etcd_server.endpoint, "--job-id", job_id, "--host-id", name,
                               "--host-addr", "127.0.0.1", "--nproc-per-node", workers, "--min-np", "4",
                               "--max-np", "4", "--rdzv-timeout", "15", "--log-dir", str(home / "logs"),
                               str(ENV_PROBE), "--out", str(home / "env.jsonl")], name=name))
        if name == "first":  # registered first: it leads
            wait_until(lambda: events_named(jobs[0], "member_joined"), 60, "the first agent to register")
    for job in jobs:
        assert job.wait(120) == 1, job.text()[-3000:]
    for job in jobs:
        assert "waiting for workers: 3 of 4 present, failing in" in job.text(), job.text()[-3000:]
    # The notice went with the job: nothing is left under control/waiting.
    assert etcd.get(JobKeys(job_id).waiting) is None


# ----------------------------------------------------------------------------- two jobs on one etcd


@heavy
def test_two_jobs_on_one_etcd_at_once_both_finish_without_cross_talk(tmp_path, etcd_server, etcd):
    jobs = {}
    for name, steps in (("a", 40), ("b", 60)):
        directory = tmp_path / name
        directory.mkdir()
        job_id = new_job_id(f"two-{name}")
        jobs[name] = (job_id, steps, train(directory, ["--rdzv-endpoint", etcd_server.endpoint, "--job-id", job_id,
                                                       "--host-addr", "127.0.0.1", "--nproc-per-node", "2",
                                                       "--min-np", "2", "--max-np", "4"],
                                           ["--steps", str(steps), "--step-delay", "0.02"], name=name))
    for job_id, steps, job in jobs.values():
        assert job.wait(240) == 0, job.text()[-3000:]
    params = {}
    for name, (job_id, steps, job) in jobs.items():
        # Each job ran its own steps once each, in a ring of its own two workers.
        rank0 = [s["step"] for s in job.steps() if s["rank"] == 0]
        assert sorted(rank0) == list(range(1, steps + 1)), name
        assert {s["world"] for s in job.steps()} == {2}, name
        assert [e["world_size"] for e in events_named(job, "round_formed")] == [2], name
        assert_identical(finals(job.out))
        params[name] = finals(job.out)[0]
        # Its rounds in etcd hold only its own member.
        (member,) = {e["member"] for e in events_named(job, "agent_started")}
        kvs, _ = etcd.get_prefix(JobKeys(job_id).prefix + "rounds/")
        assert kvs and all(RoundPlan.from_json(kv.value).member_order() == [member] for kv in kvs), name
    assert any(not torch.equal(params["a"][k], params["b"][k]) for k in params["a"])  # 40 steps vs 60


# ----------------------------------------------------------------------------- torchrun's variables, -m


def test_a_torchrun_script_sees_torchruns_variables(tmp_path, etcd_server):
    job_id = new_job_id("torchrun-env")
    out = tmp_path / "env.jsonl"
    common = ["--rdzv-endpoint", etcd_server.endpoint, "--job-id", job_id, "--host-addr", "127.0.0.1",
              "--min-np", "3", "--max-np", "3", "--log-dir", str(tmp_path / "logs")]
    two = Job(tmp_path, [*common, "--nproc-per-node", "2", "--host-id", "host-two", str(ENV_PROBE), "--out", str(out)],
              name="two")
    one = Job(tmp_path, [*common, "--nproc-per-node", "1", "--host-id", "host-one", str(ENV_PROBE), "--out", str(out)],
              name="one")
    assert two.wait(240) == 0, two.text()[-3000:]
    assert one.wait(240) == 0, one.text()[-3000:]
    records = read_jsonl(out)
    assert len(records) == 3, records
    by_agent = {two.proc.pid: [], one.proc.pid: []}
    for r in records:
        by_agent[r["agent_pid"]].append(r)
    assert [len(by_agent[two.proc.pid]), len(by_agent[one.proc.pid])] == [2, 1], records
    assert sorted(int(r["RANK"]) for r in records) == [0, 1, 2]
    for agent_pid, mine in by_agent.items():
        assert sorted(int(r["LOCAL_RANK"]) for r in mine) == list(range(len(mine)))
        assert {r["LOCAL_WORLD_SIZE"] for r in mine} == {str(len(mine))}
        assert len({r["GROUP_RANK"] for r in mine}) == 1  # one group rank per agent (node)
    groups = {agent: int(mine[0]["GROUP_RANK"]) for agent, mine in by_agent.items()}
    assert sorted(groups.values()) == [0, 1]
    # As under torchrun, a node's ranks follow its group rank: group 0 holds the lowest ranks.
    first, second = sorted(by_agent, key=groups.get)
    assert max(int(r["RANK"]) for r in by_agent[first]) < min(int(r["RANK"]) for r in by_agent[second])
    for r in records:
        assert r["WORLD_SIZE"] == "3"
        assert r["GROUP_WORLD_SIZE"] == "2"  # two agents (nodes) in the round
        # One role, as torchrun's default --role: role ranks are the global ranks.
        assert r["ROLE_NAME"] == "default"
        assert r["ROLE_RANK"] == r["RANK"] and r["ROLE_WORLD_SIZE"] == "3"
        assert r["TORCHELASTIC_RUN_ID"] == job_id
        assert r["TORCHELASTIC_RESTART_COUNT"] == "0"  # torchrun: no restart yet
        assert r["TORCHELASTIC_MAX_RESTARTS"] == "0"  # elastic-run's default --max-restarts
        assert r["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert len({(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in records}) == 1


def test_a_restarted_torchrun_worker_sees_restart_count_1_and_dash_m_runs_a_module_warm_or_cold(tmp_path):
    """Two jobs at once. One (a script path, warm starts: the default) loses rank 1 once:
    its replacement and its restarted peer see TORCHELASTIC_RESTART_COUNT 1. The other
    (-m MODULE, --cold-starts: fresh interpreters) runs the module as __main__ with its
    arguments. What a script can see of how its process started must be the same in both."""
    (tmp_path / "warm").mkdir()
    (tmp_path / "cold").mkdir()
    out, cold_out = tmp_path / "warm" / "env.jsonl", tmp_path / "cold" / "env.jsonl"
    job = Job(tmp_path / "warm", ["--np", "2", "--max-restarts", "2", "--log-dir", str(tmp_path / "warm" / "logs"),
                                  str(ENV_PROBE), "--out", str(out), "--die-once", str(tmp_path / "died")])
    cold = Job(tmp_path / "cold", ["--np", "2", "--cold-starts", "--log-dir", str(tmp_path / "cold" / "logs"), "-m",
                                   "tests.fakes.env_probe", "--out", str(cold_out), "--flag", "value"], name="cold")
    assert job.wait(180) == 0, job.text()[-3000:]
    assert cold.wait(180) == 0, cold.text()[-3000:]
    records = read_jsonl(out)
    died = [r for r in records if r.get("died")]
    assert [(r["RANK"], r["TORCHELASTIC_RESTART_COUNT"]) for r in died] == [("1", "0")], records
    # The crashed worker's replacement and its peer, restarted with it for the new round,
    # both count the one restart the agent made (of --max-restarts 2).
    ran = [r for r in records if not r.get("died")]
    assert sorted(r["RANK"] for r in ran) == ["0", "1"], records
    assert {(r["TORCHELASTIC_RESTART_COUNT"], r["TORCHELASTIC_MAX_RESTARTS"]) for r in ran} == {("1", "2")}, records
    killed = [e for e in events_named(job, "worker_exited") if e["signal"] == signal.SIGKILL]
    assert len(killed) == 1, killed
    module_runs = read_jsonl(cold_out)
    assert sorted(int(r["RANK"]) for r in module_runs) == [0, 1]
    for r in module_runs:
        assert r["main"] is True
        assert r["argv"] == ["--out", str(cold_out), "--flag", "value"]
    # Warm starts: all three of the first job were forked from its agent's template with
    # torch imported; the second job's were fresh interpreters. Each drew its own seeds,
    # the two started after the crash saw none of what the crashed one changed in its
    # process (sys.path, sys.modules, warnings, torch's threads and seed), and torch's
    # threads and the warnings filters are a fresh process's.
    assert all(r["warm"] for r in records) and not any(r["warm"] for r in module_runs), (records, module_runs)
    facts = {(r["threads"], r["filters"], r["changed"], r["cuda"]) for r in records + module_runs}
    assert facts == {(1, module_runs[0]["filters"], False, False)}, (records, module_runs)
    for draw in ("torch_seed", "numpy_draw", "random_draw"):
        assert len({r[draw] for r in records + module_runs}) == 5, (draw, records, module_runs)


# ----------------------------------------------------------------------------- bad ELASTIC_* values


@pytest.mark.parametrize(
    "variable, value, names",
    [
        # The line names the variable the bad value came from, not the option.
        ("ELASTIC_NP", "two", "ELASTIC_NP='two'"),
        ("ELASTIC_MIN_NP", "0", "ELASTIC_MIN_NP='0'"),
        ("ELASTIC_RDZV_TTL", "-1", "ELASTIC_RDZV_TTL='-1'"),
        ("ELASTIC_RDZV_SETTLE", "soon", "ELASTIC_RDZV_SETTLE='soon'"),
        ("ELASTIC_MAX_RESTARTS", "-2", "ELASTIC_MAX_RESTARTS='-2'"),
        ("ELASTIC_HEALTH_PORT", "http", "ELASTIC_HEALTH_PORT='http'"),
        ("ELASTIC_BACKEND", "tpu", "--backend"),
        ("ELASTIC_RDZV_ENDPOINT", "nohost:", "--job-id is required"),
    ],
)
def test_a_bad_elastic_variable_gives_one_line_and_exit_2(tmp_path, variable, value, names):
    (tmp_path / "x.py").write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    env.update({"PYTHONPATH": str(REPO), variable: value})
    args = ["x.py"] if variable == "ELASTIC_NP" else ["--np", "1", "x.py"]
    result = subprocess.run([*ELASTIC_RUN, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("elastic-run: error: "), result.stderr
    assert names in lines[0]
    assert value in lines[0] or variable == "ELASTIC_RDZV_ENDPOINT", lines[0]


# ----------------------------------------------------------------------------- TLS and a password


@pytest.fixture(scope="module")
def secure_etcd(tmp_path_factory):
    """An etcd that wants TLS with a client certificate AND a user name and password."""
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    server = tls_etcd_server(etcd_binary_or_skip(), pki).start()
    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(pki["ca"]).read_bytes(), private_key=Path(pki["client_key"]).read_bytes(),
        certificate_chain=Path(pki["client_cert"]).read_bytes())
    channel = grpc.secure_channel(server.endpoint, credentials)
    auth = etcdrpc.AuthStub(channel)
    auth.UserAdd(etcdrpc.AuthUserAddRequest(name="root", password="s3cret"), timeout=5)
    auth.RoleAdd(etcdrpc.AuthRoleAddRequest(name="root"), timeout=5)
    auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=5)
    auth.AuthEnable(etcdrpc.AuthEnableRequest(), timeout=5)
    channel.close()
    yield server, pki
    server.stop()


def secure_options(server, pki, password: str, directory: Path) -> list[str]:
    """The password from a 0600 file, as on a shared host (--etcd-password would be in ps, and warned about)."""
    password_file = directory / "etcd-password"
    password_file.write_text(password + "\n")
    password_file.chmod(0o600)
    return ["--rdzv-endpoint", f"https://{server.endpoint}", "--etcd-ca", pki["ca"], "--etcd-cert", pki["client_cert"],
            "--etcd-key", pki["client_key"], "--etcd-user", "root", "--etcd-password-file", str(password_file)]


@heavy
def test_an_agent_and_its_workers_run_over_tls_with_a_password(tmp_path, secure_etcd):
    server, pki = secure_etcd
    job_id = new_job_id("secure")
    job = train(tmp_path, [*secure_options(server, pki, "s3cret", tmp_path), "--job-id", job_id, "--host-addr", "127.0.0.1",
                           "--nproc-per-node", "2", "--min-np", "2"],
                ["--steps", "20", "--step-delay", "0.02"])
    assert job.wait(240) == 0, job.text()[-3000:]
    assert_identical(finals(job.out))
    assert len(finals(job.out)) == 2
    # The workers followed the plan themselves: they read it from etcd with the same credentials.
    assert [e["world_size"] for e in events_named(job, "round_formed")] == [2]
    with Etcd(server.config(user="root", password="s3cret")) as client:
        plan = RoundPlan.from_json(client.get(JobKeys(job_id).plan).value)
        status = json.loads(client.get(JobKeys(job_id).status).value)
    assert plan.world_size == 2 and status["state"] == "succeeded", status


def test_a_wrong_etcd_password_fails_the_agent_at_once_with_one_line(tmp_path, secure_etcd):
    server, pki = secure_etcd
    started = time.monotonic()
    job = train(tmp_path, [*secure_options(server, pki, "wrong", tmp_path), "--job-id", new_job_id("secure"),
                           "--host-addr", "127.0.0.1", "--nproc-per-node", "1", "--min-np", "1"],
                ["--steps", "5"])
    assert job.wait(60) == 1, job.text()
    assert time.monotonic() - started < 30  # not retried for the 30 s retry deadline
    assert agent_lines(job.text()) == [f"elastic-run: etcd at {server.endpoint} rejected user 'root': "
                                       "wrong user name or password"], job.text()
