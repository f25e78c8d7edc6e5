"""A real Slurm cluster on one machine: slurmctld beside one slurmd per namespaced host.

Debian's ``slurm-wlm`` and ``munge`` (installed here when missing, if apt can) run as
root with a configuration written into a temp dir: munged on its own socket,
slurmctld in the root namespace on the bridge address, and one ``slurmd -N NAME`` per
host of tests/fakes/netns.py. What makes that work (measured on this machine):

* each slurmd enters its host's network namespace with ``nsenter --net=...``, not
  ``ip netns exec``, which remounts /sys and hides the cgroup mounts slurmd wants;
* each slurmd gets its own host name (``unshare --uts`` + ``hostname NAME``) and an
  ``/etc/hosts`` line for its address: with one shared host name, srun's callbacks
  go to the wrong address and a step whose node died never ends. /etc/hosts is
  restored at tear-down, whatever happened.

Tear-down kills every daemon (and whatever still runs in the hosts), removes the
namespaces and restores /etc/hosts, also after a failed test. Clients (sbatch,
scontrol, squeue, scancel) run with ``SLURM_CONF`` pointing at our file.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from tests.fakes import netns
from tests.fakes.waiting import poll

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol", "squeue", "scancel", "srun")
HOSTS_FILE = Path("/etc/hosts")


class SlurmUnavailable(Exception):
    """Slurm cannot run here (no packages and no way to install them, no namespaces): tests skip."""


def _missing() -> list[str]:
    return [name for name in DAEMONS if shutil.which(name) is None]


def ensure_installed() -> None:
    """Install Debian's slurm-wlm and munge if they are missing (apt-get update once if needed)."""
    if not _missing():
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SlurmUnavailable(f"{', '.join(_missing())} missing and no apt-get as root to install slurm-wlm munge")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "slurm-wlm", "munge"]
    try:
        done = subprocess.run(install, capture_output=True, text=True, timeout=600, env=env)
        if done.returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=300, env=env)
            done = subprocess.run(install, capture_output=True, text=True, timeout=600, env=env)
    except subprocess.TimeoutExpired:
        raise SlurmUnavailable("apt-get install slurm-wlm munge timed out") from None
    if _missing():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["?"]
        raise SlurmUnavailable(f"cannot install slurm-wlm munge: {tail[0]}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class HostsFileLines:
    """Lines added to /etc/hosts and removed again by ``restore``: only ours, under a lock,
    so two clusters at once (a test run and a benchmark) leave the file as it was."""

    def __init__(self, lines: list[str]):
        self._lines = [f"{line}  # slurm-test-{os.getpid()}" for line in lines]
        self._restored = False
        with self._locked():
            # Written in place (not replaced): /etc/hosts may be a bind mount.
            HOSTS_FILE.write_text(HOSTS_FILE.read_text().rstrip("\n") + "\n" + "".join(f"{x}\n" for x in self._lines))

    def restore(self) -> None:
        if self._restored:
            return
        with self._locked():
            mine = set(self._lines)
            kept = [line for line in HOSTS_FILE.read_text().splitlines() if line not in mine]
            HOSTS_FILE.write_text("".join(f"{line}\n" for line in kept))
        self._restored = True

    @staticmethod
    def _locked():
        import contextlib

        @contextlib.contextmanager
        def held():
            netns.REGISTRY.mkdir(parents=True, exist_ok=True)
            with open(netns.REGISTRY / ".hosts-lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                yield
        return held()


class SlurmCluster:
    """munged + slurmctld + one slurmd per namespaced host; ``nodes`` are the hosts."""

    def __init__(self, count: int, work: Path):
        self.work = work
        self.hosts: Optional[netns.Hosts] = None
        self._daemons: dict[str, subprocess.Popen] = {}
        self._hosts_file: Optional[HostsFileLines] = None
        self.env = dict(os.environ)
        work.mkdir(parents=True, exist_ok=True)
        try:
            self.hosts = netns.Hosts(count, etcd=False)
            self._hosts_file = HostsFileLines([f"{host.addr} {host.name}" for host in self.hosts])
            self.conf = self._write_config()
            self.env["SLURM_CONF"] = str(self.conf)
            self._start_munge()
            self._start("slurmctld", ["slurmctld", "-D", "-f", str(self.conf), "-L", str(work / "slurmctld.log")])
            for host in self.hosts:
                self.start_slurmd(host)
            self.wait_idle(list(self.hosts), 60)
        except BaseException:
            self.destroy()
            raise

    # -- clients

    def run(self, *argv: str, check: bool = True, timeout: float = 30) -> str:
        done = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.stdout.strip()}")
        return done.stdout

    def sbatch(self, *argv: str, env: Optional[dict] = None) -> str:
        """Submit; the job id. The job gets our environment (sbatch exports it) without the
        ELASTIC_* options of whoever runs the tests (the etcd binary's choice kept), plus ``env``."""
        ours = {k: v for k, v in self.env.items() if not k.startswith("ELASTIC_") or k == "ELASTIC_ETCD_BINARY"}
        done = subprocess.run(["sbatch", "--parsable", *argv], capture_output=True, text=True, timeout=30,
                              env={**ours, **(env or {})})
        if done.returncode != 0:
            raise RuntimeError(f"sbatch: {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def job_state(self, job_id: str) -> str:
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False)
        for field in out.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "GONE"

    def job_field(self, job_id: str, name: str) -> Optional[str]:
        for field in self.run("scontrol", "-o", "show", "job", job_id, check=False).split():
            if field.startswith(f"{name}="):
                return field.split("=", 1)[1]
        return None

    def wait_job(self, job_id: str, timeout: float, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                             "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")) -> str:
        state = poll(lambda: (s := self.job_state(job_id)) in states and s, timeout, 0.3)
        if not state:
            raise AssertionError(f"job {job_id} still {self.job_state(job_id)} after {timeout:g}s:\n{self.logs()}")
        return state

    def wait_idle(self, hosts, timeout: float) -> None:
        """Until every given node is idle (its slurmd registered, no job on it)."""
        names = ",".join(host.name for host in hosts)

        def idle():
            states = self.run("sinfo", "-h", "-N", "-n", names, "-o", "%N %t", check=False).split("\n")
            return all(line.split()[-1] == "idle" for line in states if line.strip()) and len(
                [line for line in states if line.strip()]) == len(hosts)
        if not poll(idle, timeout, 0.3):
            raise RuntimeError(f"nodes not idle after {timeout:g}s: {self.run('sinfo', '-N', check=False)}\n"
                               f"{self.logs()}")

    # -- nodes

    def start_slurmd(self, host: netns.Host) -> None:
        log = self.work / f"slurmd-{host.name}.log"
        script = f"hostname {host.name} && exec slurmd -D -N {host.name} -f {self.conf} -L {log}"
        self._start(f"slurmd-{host.name}",
                    ["nsenter", f"--net=/run/netns/{host.name}", "unshare", "--uts", "sh", "-c", script])

    def live_nodes(self) -> list:
        """The hosts whose slurmd runs (kill_node stops one for good, until resume_node)."""
        return [host for host in self.hosts if f"slurmd-{host.name}" in self._daemons]

    def kill_node(self, host: netns.Host) -> None:
        """SIGKILL the node's slurmd and everything running on it (a node that died)."""
        netns._kill_processes_in(host.name)
        process = self._daemons.pop(f"slurmd-{host.name}", None)
        if process is not None:
            process.wait(10)

    def resume_node(self, host: netns.Host) -> None:
        """Start a killed node's slurmd again and bring it back into service."""
        self.start_slurmd(host)
        self.run("scontrol", "update", f"NodeName={host.name}", "State=RESUME", check=False)
        self.wait_idle([host], 60)

    # -- tear-down

    def logs(self) -> str:
        parts = []
        for path in sorted(self.work.glob("slurm*.log")):
            parts.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(parts)

    def destroy(self) -> None:
        for name, process in reversed(list(self._daemons.items())):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self._daemons.values():
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
        self._daemons.clear()
        if self.hosts is not None:
            self.hosts.destroy()  # kills whatever the nodes still ran (slurmstepd, jobs)
        if self._hosts_file is not None:
            self._hosts_file.restore()

    # -- building

    def _start(self, name: str, argv: list[str]) -> None:
        out = open(self.work / f"{name}.out", "wb")
        self._daemons[name] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                               start_new_session=True)
        out.close()
        time.sleep(0.2)
        if self._daemons[name].poll() is not None:
            raise RuntimeError(f"{name} exited at once: {(self.work / f'{name}.out').read_text()[-2000:]}")

    def _start_munge(self) -> None:
        self.munge_socket = self.work / "munge.socket"
        key = self.work / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._start("munged", [
            "munged", "--foreground", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
            f"--pid-file={self.work / 'munged.pid'}", f"--log-file={self.work / 'munged.log'}",
            f"--seed-file={self.work / 'munged.seed'}",
        ])
        if not poll(self.munge_socket.exists, 20, 0.1):
            raise RuntimeError(f"munged did not create its socket: {(self.work / 'munged.out').read_text()[-1000:]}")

    def _write_config(self) -> Path:
        hosts, work = self.hosts, self.work
        (work / "state").mkdir(exist_ok=True)
        for host in hosts:
            (work / "spool" / host.name).mkdir(parents=True, exist_ok=True)
        nodes = "\n".join(f"NodeName={host.name} NodeAddr={host.addr} CPUs=2 RealMemory=1000 State=UNKNOWN"
                          for host in hosts)
        names = ",".join(host.name for host in hosts)
        conf = work / "slurm.conf"
        conf.write_text(f"""\
ClusterName=elastic
SlurmctldHost={socket.gethostname()}({hosts.bridge_addr})
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
AuthInfo=socket={work / 'munge.socket'}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={work / 'state'}
SlurmdSpoolDir={work / 'spool'}/%n
SlurmctldPidFile={work / 'slurmctld.pid'}
SlurmdPidFile={work / 'spool'}/slurmd-%n.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/linear
SchedulerType=sched/builtin
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=5
MinJobAge=300
InactiveLimit=0
SlurmdTimeout=30
MessageTimeout=10
{nodes}
PartitionName=main Nodes={names} Default=YES MaxTime=INFINITE State=UP
""")
        (work / "cgroup.conf").write_text("CgroupPlugin=autodetect\n")
        return conf


class SlurmJob:
    """One ``sbatch deploy/slurm/elastic-run.sbatch ELASTIC_RUN_ARGS`` of the cluster, with its files:
    ``out`` (train_job.py's), ``logs/<node>/`` (each agent's --log-dir), ``output`` (Slurm's)."""

    def __init__(self, cluster: SlurmCluster, tmp: Path, nodes: str, args: list[str], *,
                 sbatch_args: tuple[str, ...] = (), env: Optional[dict] = None, out: Optional[Path] = None):
        from tests.fakes.jobs import REPO

        self.cluster, self.tmp = cluster, tmp
        self.out = out or tmp / "out"
        self.logs = tmp / "logs"
        self.output = tmp / "slurm.out"
        tmp.mkdir(parents=True, exist_ok=True)
        wrapper = tmp / "elastic-run"  # each node's agent logs into its own directory
        wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} -m elastic.cli --log-dir {self.logs}/$SLURMD_NODENAME "
                           f"\"$@\"\n")
        wrapper.chmod(0o755)
        job_env = {"PYTHONPATH": str(REPO), "ELASTIC_RUN": str(wrapper), **(env or {})}
        self.submitted = time.time()
        self.id = cluster.sbatch(f"--nodes={nodes}", "--chdir", str(REPO), "--output", str(self.output),
                                 *sbatch_args, str(REPO / "deploy" / "slurm" / "elastic-run.sbatch"),
                                 "--backend", "gloo", *args, env=job_env)

    def steps(self) -> list[dict]:
        from tests.fakes.jsonl import read_jsonl

        return read_jsonl(self.out / "steps.jsonl")

    def events(self) -> list[dict]:
        from tests.fakes.jsonl import read_jsonl

        return [e for path in sorted(self.logs.glob("*/events.jsonl")) for e in read_jsonl(path)]

    def text(self) -> str:
        return self.output.read_text(errors="replace") if self.output.exists() else ""

    def wait_for_step(self, step: int, timeout: float = 240) -> None:
        if not poll(lambda: any(s["step"] >= step for s in self.steps()), timeout, 0.1):
            raise AssertionError(f"job {self.id}: no step {step} after {timeout:g}s ({self.cluster.job_state(self.id)})"
                                 f":\n{self.text()[-3000:]}\n{self.cluster.logs()}")

    def wait(self, timeout: float = 300) -> str:
        return self.cluster.wait_job(self.id, timeout)

    def step_on(self, node: str) -> str:
        """The id (JOB.STEP) of the step running on ``node``."""
        for line in self.cluster.run("squeue", "-h", "-s", "-j", self.id, "-o", "%i %N").splitlines():
            step, where = line.split()
            if where == node and not step.endswith(".batch"):
                return step
        raise AssertionError(f"job {self.id} has no step on {node}")

    def nodes(self) -> list[str]:
        """The allocation's nodes, first (the one serving the embedded etcd) first."""
        listed = self.cluster.job_field(self.id, "NodeList")
        return self.cluster.run("scontrol", "show", "hostnames", listed).split()
