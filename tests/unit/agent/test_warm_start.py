"""The template that forks workers (warm_start.py, worker/template.py), with a real
template process that preloads nothing (no torch: cheap) and real forked workers."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from elastic.agent.warm_start import WorkerTemplate, why_not_warm
from elastic.agent.worker_env import is_per_worker, worker_env
from elastic.contract.worker_config import WorkerConfig
from elastic.rendezvous import RoundPlan
from elastic.rendezvous.rounds import Slot

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

PROBE = """\
import json, os, signal, sys
print(json.dumps(dict(argv=sys.argv, main=__name__, path0=sys.path[0], cwd=os.getcwd(), rank=os.environ.get("RANK"),
    shared=os.environ.get("SHARED"), sid=os.getsid(0) == os.getpid(), stdin=os.readlink("/proc/self/fd/0"),
    fds=sorted(int(fd) for fd in os.listdir("/proc/self/fd")), sigint=str(signal.getsignal(signal.SIGINT)),
    sigchld=signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL, mask=sorted(signal.pthread_sigmask(signal.SIG_BLOCK, []))),
    ), flush=True)
sys.path.insert(0, "/polluted")
sys.modules["polluted"] = object()
if sys.argv[1:2] == ["crash"]:
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
"""


def base_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not is_per_worker(k)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    env["SHARED"] = "same"
    env.update(extra)
    return env


@pytest.fixture
def template():
    t = WorkerTemplate(preload="json", ready_wait=60)
    yield t
    t.close()


def run_one(template, script, args, env, cwd):
    read_end, write_end = os.pipe()
    proc = template.start([str(script), *args], env, str(cwd), write_end)
    os.close(write_end)
    if proc is None:
        os.close(read_end)
        return None, None, None
    with os.fdopen(read_end, "rb") as out:
        output = out.read().decode()
    return proc, proc.wait(30), output


def test_forked_workers_start_as_fresh_processes_and_report_their_exits(template, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    seen = []
    for rank, args, expected in (("0", ["ok", "3"], 3), ("1", ["crash"], -signal.SIGKILL)):
        proc, code, output = run_one(template, script, args, base_env(RANK=rank), tmp_path)
        assert proc is not None, "the template did not fork the worker"
        assert code == expected and proc.returncode == expected and proc.poll() == expected
        seen.append(json.loads(output))
    for rank, facts in enumerate(seen):
        assert facts["argv"][0] == str(script) and facts["main"] == "__main__"
        assert facts["path0"] == str(tmp_path), "sys.path[0] is the script's folder, as for python SCRIPT"
        assert facts["cwd"] == str(tmp_path) and facts["rank"] == str(rank) and facts["shared"] == "same"
        assert facts["sid"], "each worker leads its own session"
        assert facts["stdin"] == "/dev/null" and facts["fds"][:3] == [0, 1, 2] and len(facts["fds"]) == 4  # + listdir's
        # As a fresh interpreter started here would have it (ignored when we were started with
        # SIGINT ignored, as a background job of a non-interactive shell is).
        assert facts["sigint"] == str(signal.getsignal(signal.SIGINT)) and facts["sigchld"]
        assert facts["mask"] == []
    # The second worker did not see what the first did to sys.path and sys.modules (its
    # own fork of the template), and did see its own argv.
    assert seen[1]["argv"][1:] == ["crash"]


def test_a_worker_whose_environment_differs_in_a_shared_setting_starts_fresh(template, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    proc, *_ = run_one(template, script, ["ok"], base_env(RANK="0"), tmp_path)
    assert proc is not None
    # OMP_NUM_THREADS is read when torch is imported: the template's import saw another value.
    proc, *_ = run_one(template, script, ["ok"], base_env(RANK="1", OMP_NUM_THREADS="7"), tmp_path)
    assert proc is None
    # Per-worker variables may differ.
    proc, code, _ = run_one(template, script, ["ok"], base_env(RANK="2", ELASTIC_WORKER_ROUND="9"), tmp_path)
    assert proc is not None and code == 0
    # A value that is not text (an undecodable byte, as Python keeps it) reaches the worker as it was.
    script.write_text("import os\nprint(os.environb[b'ELASTIC_WORKER_X'].hex())\n")
    proc, code, output = run_one(template, script, [], base_env(RANK="3", ELASTIC_WORKER_X="\udcff"), tmp_path)
    assert proc is not None and code == 0 and output == "ff\n"


def test_workers_of_a_template_that_dies_are_reported_killed_and_later_starts_are_fresh(template, tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    read_end, write_end = os.pipe()
    proc = template.start([str(script)], base_env(RANK="0"), str(tmp_path), write_end)
    os.close(write_end)
    assert proc is not None
    with os.fdopen(read_end, "rb") as out:
        assert out.readline() == b"up\n"
        template._proc.kill()  # the template's parent-death signal takes its workers along
        assert proc.wait(15) == -signal.SIGKILL
    assert run_one(template, script, [], base_env(RANK="1"), tmp_path)[0] is None


def test_off_or_without_a_template_every_worker_starts_fresh(tmp_path):
    off = WorkerTemplate(False)
    assert off.start(["x.py"], base_env(), str(tmp_path), 1) is None
    off.close()
    broken = WorkerTemplate(preload="no_such_module_here", ready_wait=60)
    assert broken.start(["x.py"], base_env(), str(tmp_path), 1) is None
    assert "no_such_module_here" in broken._why_not
    broken.close()


def test_a_template_dies_with_the_thread_that_started_it(tmp_path):
    """Like a worker started directly, the template (and so its workers) gets SIGKILL when
    the agent's thread that started it ends: nothing outlives the agent."""
    template = WorkerTemplate(preload="json", ready_wait=60)
    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(60)\n")
    started = {}

    def agent_thread():
        read_end, write_end = os.pipe()
        started["proc"] = template.start([str(script)], base_env(RANK="0"), str(tmp_path), write_end)
        os.close(write_end)
        os.close(read_end)

    thread = threading.Thread(target=agent_thread)
    thread.start()
    thread.join()
    assert started["proc"].wait(15) == -signal.SIGKILL
    assert template._proc.wait(15) == -signal.SIGKILL
    template.close()


def _worker_env(worker: str, slot: int, round_number: int, restarts: int) -> dict:
    workers = ("m.w0", "m.w1", "m.w2", "m.w3")[:3 + (round_number > 3)]
    plan = RoundPlan(round=round_number, slots=tuple(Slot("m", w) for w in workers), hosts={"m": ("h", "10.0.0.1")},
                     store_addr="10.0.0.1:1", created=time.time())
    config = WorkerConfig(job_id="j", endpoints="e:1", worker_id=worker, member_id="m", host_id="h",
                          round=round_number, backend="nccl", device_slot=slot)
    return worker_env({"PATH": "/bin", "OMP_NUM_THREADS": "2"}, plan=plan, worker_id=worker, member_id="m",
                      master=("10.0.0.1", 2 + round_number), worker_config=config, nproc_per_node=4,
                      socket_ifname="eth0", restart_count=restarts, max_restarts=3, device_slot=slot)


def test_what_differs_between_two_workers_environments_names_the_worker():
    """Everything else is the template's: a forked worker gets only these from its request."""
    first, second = _worker_env("m.w0", 0, 3, 0), _worker_env("m.w3", 1, 4, 1)
    differs = {k for k in set(first) | set(second) if first.get(k) != second.get(k)}
    assert {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
            "ELASTIC_WORKER_WORKER_ID"} <= differs
    assert all(is_per_worker(k) for k in differs)
    for name in ("OMP_NUM_THREADS", "PYTHONPATH", "LD_PRELOAD", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                 "NCCL_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES", "PATH"):
        assert not is_per_worker(name)


SCRIPTS = {"train.py": "import torch\n", "api.py": "import elastic\n", "plain.py": "print('hello')\n"}


@pytest.mark.parametrize("command, nproc, max_restarts, warm", [
    (["train.py", "--x"], 2, 0, True),     # two workers: the second start pays for the template
    (["train.py"], 1, 1, True),            # one worker, but its replacement would
    (["train.py"], 1, 0, False),           # one start only: nothing to gain
    (["api.py"], 4, 0, True),              # the elastic API imports torch
    (["plain.py"], 4, 3, False),           # never imports torch: the template would cost, not save
    (["-m", "pkg.train"], 2, 0, True),     # a module: taken to import torch
    (["missing.py"], 2, 0, True),          # cannot read it: its start will say why
])
def test_a_template_only_where_it_pays_for_itself(command, nproc, max_restarts, warm):
    def read(path):
        if path not in SCRIPTS:
            raise FileNotFoundError(path)
        return SCRIPTS[path]

    assert (why_not_warm(command, nproc, max_restarts, read) is None) == warm


def test_with_start_up_code_of_its_own_on_pythonpath_every_worker_starts_fresh(tmp_path):
    """A sitecustomize on PYTHONPATH runs as each interpreter starts, with that process's
    environment (the test fakes' fault plans look for a worker id): the template's run of
    it is not the worker's, so no worker is forked."""
    custom = tmp_path / "custom"
    custom.mkdir()
    (custom / "sitecustomize.py").write_text("import os\nSEEN = os.environ.get('ELASTIC_WORKER_WORKER_ID')\n")
    env = base_env(RANK="0")
    env["PYTHONPATH"] = os.pathsep.join([str(custom), env["PYTHONPATH"]])
    template = WorkerTemplate(preload="json", ready_wait=60)
    try:
        assert template.start(["x.py"], env, str(tmp_path), 1) is None
        assert "sitecustomize.py runs at each interpreter's start" in template._why_not
    finally:
        template.close()
