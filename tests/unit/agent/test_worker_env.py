"""A worker's environment: its device slot as LOCAL_RANK, and NCCL's settings (as tables)."""

from __future__ import annotations

import time

import pytest

from elastic.agent.worker_env import nccl_env, nccl_waits, nonblocking_for, worker_env
from elastic.contract.devices import CPU_AND_CUDA
from elastic.contract.worker_config import WorkerConfig
from elastic.rendezvous import RoundPlan
from elastic.rendezvous.rounds import Slot


def _env(backend="gloo", base=None, slot=0, workers=("m.w0", "m.w1", "m.w2"), worker="m.w2", max_world_size=None):
    plan = RoundPlan(round=3, slots=tuple(Slot("m", w) for w in workers), hosts={"m": ("h", "10.0.0.1")},
                     store_addr="10.0.0.1:1", created=time.time())
    config = WorkerConfig(job_id="j", endpoints="e:1", worker_id=worker, member_id="m", host_id="h", round=3,
                          backend=backend, device_slot=slot)
    return worker_env(base or {}, plan=plan, worker_id=worker, member_id="m", master=("10.0.0.1", 2),
                      worker_config=config, nproc_per_node=4, socket_ifname="eth0", restart_count=1,
                      max_restarts=1, device_slot=slot, max_world_size=max_world_size)


def test_local_rank_is_the_device_slot_not_the_position_in_the_plan():
    # m.w1 (slot 1) was lost; its replacement m.w3 is third in the plan's order but on slot 1.
    env = _env(slot=1, workers=("m.w0", "m.w2", "m.w3"), worker="m.w3")
    assert env["LOCAL_RANK"] == "1" and env["LOCAL_WORLD_SIZE"] == "3" and env["RANK"] == "2"
    assert WorkerConfig.from_env(env).device_slot == 1


@pytest.mark.parametrize("backend, expected", [
    ("gloo", {}),
    ("nccl", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "1000",
              "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0", "NCCL_NVLS_ENABLE": "0",
              "TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_NCCL_NONBLOCKING_TIMEOUT": "30",
              "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "45"}),
    (CPU_AND_CUDA, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "1000",
                    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0", "NCCL_NVLS_ENABLE": "0",
              "TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_NCCL_NONBLOCKING_TIMEOUT": "30",
              "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "45"}),
])
def test_nccl_settings_only_with_nccl(backend, expected):
    assert nccl_env(backend) == expected
    env = _env(backend)
    assert {k: env[k] for k in expected} == expected
    assert not any(k.startswith(("TORCH_NCCL_", "NCCL_NVLS")) for k in env) or expected
    assert ("NCCL_SOCKET_IFNAME" in env) == bool(expected)
    if expected:
        assert env["NCCL_SOCKET_IFNAME"] == "=eth0" and env["GLOO_SOCKET_IFNAME"] == "eth0"


def test_the_users_nccl_settings_win():
    mine = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "NCCL_NVLS_ENABLE": "1", "NCCL_SOCKET_IFNAME": "ib0"}
    env = _env("nccl", base=mine)
    assert {k: env[k] for k in mine} == mine
    assert env["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"] == "1000"


# Every world size up to past the cap, at and around each doubling.
WORLDS = sorted({max(1, 2 ** k + d) for k in range(21) for d in (-1, 0, 1)})


@pytest.mark.parametrize("world", WORLDS)
def test_a_communicator_that_still_forms_lets_the_abort_through_before_its_deadline(world):
    # gpu review G5(b): a collective waiting for a forming communicator holds its lock for
    # TORCH_NCCL_NONBLOCKING_TIMEOUT; the abort must get it before nccl_abort's deadline.
    from elastic.worker.nccl_abort import ABORT_DEADLINE_S

    assert float(nccl_env(CPU_AND_CUDA, world)["TORCH_NCCL_NONBLOCKING_TIMEOUT"]) < ABORT_DEADLINE_S


def test_the_agents_copy_of_the_abort_deadline_is_the_workers():
    # The agent does not import nccl_abort (it imports torch); its copy must not drift.
    from elastic.agent.worker_env import WORKER_ABORT_DEADLINE_S
    from elastic.worker.nccl_abort import ABORT_DEADLINE_S

    assert WORKER_ABORT_DEADLINE_S == ABORT_DEADLINE_S


@pytest.mark.parametrize("world, nonblocking", [
    (1, 30), (8, 30), (1024, 30),  # 30 s is ample at hundreds of ranks (G5(b))
    (1025, 45), (2048, 45), (2049, 60), (4096, 60), (8192, 75), (16384, 90), (32768, 105),
    (65536, 120), (65537, 120), (10 ** 6, 120),  # capped under the abort deadline
])
def test_the_nonblocking_wait_grows_with_the_world(world, nonblocking):
    # gpu review N6: a healthy set-up at thousands of ranks can take more than 30 s.
    assert nonblocking_for(world) == nonblocking


@pytest.mark.parametrize("world, users, waits, problem", [
    # ours: the heartbeat 15 s above the non-blocking wait (N5: 45-50 s at 30 s)
    (8, {}, (30, 45), None),
    (4096, {}, (60, 75), None),
    (10 ** 6, {}, (120, 135), None),  # the longest heartbeat that fits under the 150 s deadline
    # the user's win; the heartbeat follows their non-blocking wait
    (8, {"TORCH_NCCL_NONBLOCKING_TIMEOUT": "100"}, (100, 115), None),
    (10 ** 6, {"TORCH_NCCL_NONBLOCKING_TIMEOUT": "20"}, (20, 35), None),
    (8, {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "50"}, (30, 50), None),
    (8, {"TORCH_NCCL_NONBLOCKING_TIMEOUT": "40", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "60"}, (40, 60), None),
    # ... even out of order, which is said
    (8, {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "30"}, (30, 30),
     "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=30 (yours) is not above TORCH_NCCL_NONBLOCKING_TIMEOUT=30:"),
    (4096, {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "5"}, (60, 5), "is not above TORCH_NCCL_NONBLOCKING_TIMEOUT=60:"),
    (8, {"TORCH_NCCL_NONBLOCKING_TIMEOUT": "600"}, (600, 615),
     "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=615 is above 138: a dropped group's destructor"),
    (8, {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "480"}, (30, 480), "=480 (yours) is above 138"),
    # a value that is not a number is torch's to judge; ours stand in for the order
    (8, {"TORCH_NCCL_NONBLOCKING_TIMEOUT": "soon"}, (30, 45), None),
    (8, {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "inf"}, (30, 45), None),
])
def test_nccls_waits_keep_their_order_or_say_so(world, users, waits, problem):
    found = nccl_waits(world, users)
    assert (found.nonblocking_s, found.heartbeat_s) == waits
    said = found.out_of_order()
    if problem is None:
        assert said is None
    else:
        assert problem in said and "\n" not in said


@pytest.mark.parametrize("world", WORLDS)
def test_ours_are_in_order_at_every_world_size(world):
    from elastic.worker.nccl_abort import ABORT_DEADLINE_S

    waits = nccl_waits(world, {})
    assert waits.out_of_order() is None
    assert waits.nonblocking_s < waits.heartbeat_s < ABORT_DEADLINE_S


def test_the_waits_follow_max_np_not_the_rounds_world():
    # A worker lives through rounds of every size up to --max-np; one value for all of them
    # also keeps its environment equal to the warm-start template's.
    small, large = _env(CPU_AND_CUDA, max_world_size=4096), _env(CPU_AND_CUDA, workers=("m.w2",),
                                                                  max_world_size=4096)
    for env in (small, large):
        assert env["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "60" and env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "75"
    assert _env(CPU_AND_CUDA)["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "30"  # without it, the plan's (3 ranks)


def test_the_users_waits_win_and_ours_follow_them():
    env = _env(CPU_AND_CUDA, base={"TORCH_NCCL_NONBLOCKING_TIMEOUT": "90"}, max_world_size=8)
    assert env["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "90" and env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "105"
    assert nccl_env(CPU_AND_CUDA, 8, {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "50"})[
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "50"


def test_the_users_waits_out_of_order_are_said_once(caplog):
    base = {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "7"}  # a value no other test uses: the warning is new
    for _ in range(3):
        assert _env(CPU_AND_CUDA, base=base)["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "7"
    said = [r.getMessage() for r in caplog.records if "NCCL's waits are out of order" in r.getMessage()]
    assert said == ["NCCL's waits are out of order: TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=7 (yours) is not above "
                    "TORCH_NCCL_NONBLOCKING_TIMEOUT=30: a watchdog that waits for a forming communicator's lock "
                    "would SIGABRT its worker, counted as a crash"]
    assert not _env("gloo", base={"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "8"}).get("TORCH_NCCL_NONBLOCKING_TIMEOUT")


def test_the_users_own_nccl_settings_win():
    env = _env(CPU_AND_CUDA, base={"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"})
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"


@pytest.mark.parametrize("world", WORLDS)
def test_a_group_destructor_that_joins_a_sleeping_heartbeat_monitor_returns_before_the_abort_deadline(world):
    # gpu review G2: the monitor sleeps TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC after up to two
    # flight-recorder dumps of TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC each, and ~ProcessGroupNCCL
    # joins it; leave_aborted drops the groups under ABORT_DEADLINE_S.
    from elastic.worker.nccl_abort import ABORT_DEADLINE_S

    env = nccl_env(CPU_AND_CUDA, world)
    joined_within = float(env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"]) + 2 * float(
        env["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"]) / 1000
    assert joined_within < ABORT_DEADLINE_S - 10  # with room for the abort itself


def test_a_sticky_cuda_error_is_left_to_the_main_thread_to_classify():
    # gpu review G10: with 1 the watchdog SIGABRTs on a device-side assert before the main
    # thread can raise it as the user's error; the crash would be replaced until --max-restarts.
    assert nccl_env(CPU_AND_CUDA)["TORCH_NCCL_RETHROW_CUDA_ERRORS"] == "0"


def test_the_etcd_password_and_the_job_secret_are_not_inherited():
    env = _env(base={"ELASTIC_ETCD_PASSWORD": "s3cret", "ELASTIC_JOB_SECRET": "x" * 64, "HOME": "/h",
                     "ELASTIC_JOB_SECRET_FILE": "/h/job.secret"})  # root's password derives from it (review 2, L4)
    assert "ELASTIC_ETCD_PASSWORD" not in env and "ELASTIC_JOB_SECRET" not in env and env["HOME"] == "/h"
    assert "ELASTIC_JOB_SECRET_FILE" not in env
    assert not any("s3cret" in value for value in env.values())
