"""One real Slurm cluster per test module (tests/fakes/slurm_cluster.py), skipped with the reason where it cannot run."""

from __future__ import annotations

import pytest

from tests.fakes import netns
from tests.fakes.slurm_cluster import SlurmCluster, SlurmUnavailable, ensure_installed


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """munged, slurmctld and four slurmd on namespaced hosts; all of it gone after the module."""
    try:
        netns.check_available()
        ensure_installed()
    except (netns.NetnsUnavailable, SlurmUnavailable) as exc:
        pytest.skip(str(exc))
    netns.sweep_leftovers()
    cluster = SlurmCluster(4, tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.destroy()


@pytest.fixture(autouse=True)
def no_job_left_running(request):
    """A failed test's jobs are cancelled, so the next test finds the nodes idle."""
    yield
    cluster = request.getfixturevalue("slurm_cluster") if "slurm_cluster" in request.fixturenames else None
    if cluster is None:
        return
    left = cluster.run("squeue", "-h", "-o", "%i", check=False).split()
    if left:
        cluster.run("scancel", *left, check=False)
        cluster.wait_idle(cluster.live_nodes(), 60)
