"""A worker's environment: its device slot as LOCAL_RANK, and NCCL's settings (as tables)."""

from __future__ import annotations

import time

import pytest

from elastic.agent.worker_env import nccl_env, worker_env
from elastic.contract.devices import CPU_AND_CUDA
from elastic.contract.worker_config import WorkerConfig
from elastic.rendezvous import RoundPlan
from elastic.rendezvous.rounds import Slot


def _env(backend="gloo", base=None, slot=0, workers=("m.w0", "m.w1", "m.w2"), worker="m.w2"):
    plan = RoundPlan(round=3, slots=tuple(Slot("m", w) for w in workers), hosts={"m": ("h", "10.0.0.1")},
                     store_addr="10.0.0.1:1", created=time.time())
    config = WorkerConfig(job_id="j", endpoints="e:1", worker_id=worker, member_id="m", host_id="h", round=3,
                          backend=backend, device_slot=slot)
    return worker_env(base or {}, plan=plan, worker_id=worker, member_id="m", master=("10.0.0.1", 2),
                      worker_config=config, nproc_per_node=4, socket_ifname="eth0", restart_count=1,
                      max_restarts=1, device_slot=slot)


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
              "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "30"}),
    (CPU_AND_CUDA, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "1000",
                    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0", "NCCL_NVLS_ENABLE": "0",
              "TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_NCCL_NONBLOCKING_TIMEOUT": "30",
              "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "30"}),
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


def test_a_communicator_that_still_forms_lets_the_abort_through_before_its_deadline():
    # gpu review G5(b): a collective waiting for a forming communicator holds its lock for
    # TORCH_NCCL_NONBLOCKING_TIMEOUT; the abort must get it before nccl_abort's deadline.
    from elastic.worker.nccl_abort import ABORT_DEADLINE_S

    assert float(nccl_env(CPU_AND_CUDA)["TORCH_NCCL_NONBLOCKING_TIMEOUT"]) < ABORT_DEADLINE_S


def test_the_users_own_nccl_settings_win():
    env = _env(CPU_AND_CUDA, base={"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"})
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"


def test_a_group_destructor_that_joins_a_sleeping_heartbeat_monitor_returns_before_the_abort_deadline():
    # gpu review G2: the monitor sleeps TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC after up to two
    # flight-recorder dumps of TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC each, and ~ProcessGroupNCCL
    # joins it; leave_aborted drops the groups under ABORT_DEADLINE_S.
    from elastic.worker.nccl_abort import ABORT_DEADLINE_S

    env = nccl_env(CPU_AND_CUDA)
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
