"""Fixtures shared by the rendezvous and coordinator tests."""

from __future__ import annotations

import pytest

from tests.fakes.local_members import LocalMembers


@pytest.fixture
def job_id(job_prefix) -> str:
    return job_prefix.rstrip("/").rsplit("/", 1)[1]


@pytest.fixture
def local(etcd_server, job_id):
    members = LocalMembers(etcd_server.config(), job_id)
    yield members
    members.close()
