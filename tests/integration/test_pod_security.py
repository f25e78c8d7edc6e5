"""Every pod that deploy/ and deploy/cpu render passes the *restricted* Pod Security
Standard (security review 2, M3: the worker container added IPC_LOCK, which neither the
baseline nor the restricted level admits, so a namespace enforcing either rejected every
worker pod). Only deploy/rdma adds IPC_LOCK, and that is all it breaks.

The rules are those of Kubernetes' Pod Security Standards (v1.29+, "restricted" including
"baseline"), checked on the rendered manifests (kubectl kustomize from the test extra).
"""

from __future__ import annotations

import pytest

from tests.fakes.pods import DEPLOY_DIR, render_kustomization

_POD_KINDS = {"Pod": (), "Job": ("spec", "template"), "StatefulSet": ("spec", "template"),
              "Deployment": ("spec", "template"), "DaemonSet": ("spec", "template"),
              "ReplicaSet": ("spec", "template"), "CronJob": ("spec", "jobTemplate", "spec", "template")}
_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
_BASELINE_CAPS = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
                  "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
_SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                 "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                 "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                 "net.ipv4.tcp_keepalive_probes"}


def pods(docs: list[dict]) -> list[tuple[str, dict]]:
    found = []
    for doc in docs:
        path = _POD_KINDS.get(doc["kind"])
        if path is None:
            continue
        spec = doc
        for key in path:
            spec = spec[key]
        found.append((f"{doc['kind']}/{doc['metadata']['name']}", spec["spec"]))
    return found


def restricted_violations(pod: dict) -> list[str]:
    """What the pod spec does that the restricted level forbids (empty: it passes)."""
    out = []
    pod_ctx = pod.get("securityContext", {})
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(flag):
            out.append(f"{flag}")
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= _VOLUMES:
            out.append(f"volume {volume['name']}: {sorted(kinds - _VOLUMES)}")
    for sysctl in pod_ctx.get("sysctls", []):
        if sysctl["name"] not in _SAFE_SYSCTLS:
            out.append(f"sysctl {sysctl['name']}")
    if pod_ctx.get("seLinuxOptions", {}).get("type") not in (None, "", "container_t", "container_init_t",
                                                              "container_kvm_t", "container_engine_t"):
        out.append("seLinuxOptions.type")
    if pod_ctx.get("runAsUser") == 0:
        out.append("pod runAsUser 0")
    containers = [*pod.get("initContainers", []), *pod.get("containers", []), *pod.get("ephemeralContainers", [])]
    for container in containers:
        name, ctx = container["name"], container.get("securityContext", {})
        where = f"container {name}"
        if ctx.get("privileged"):
            out.append(f"{where}: privileged")
        caps = ctx.get("capabilities", {})
        added = set(caps.get("add", []))
        if added - _BASELINE_CAPS:
            out.append(f"{where}: adds {sorted(added - _BASELINE_CAPS)} (baseline and restricted forbid)")
        elif added - {"NET_BIND_SERVICE"}:
            out.append(f"{where}: adds {sorted(added - {'NET_BIND_SERVICE'})} (restricted forbids)")
        if "ALL" not in caps.get("drop", []):
            out.append(f"{where}: does not drop ALL capabilities")
        if ctx.get("allowPrivilegeEscalation") is not False:
            out.append(f"{where}: allowPrivilegeEscalation is not false")
        if not ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")):
            out.append(f"{where}: runAsNonRoot is not true")
        if ctx.get("runAsUser", pod_ctx.get("runAsUser")) == 0:
            out.append(f"{where}: runAsUser 0")
        seccomp = ctx.get("seccompProfile", pod_ctx.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{where}: seccompProfile {seccomp!r}")
        if ctx.get("procMount", "Default") != "Default":
            out.append(f"{where}: procMount")
        for port in container.get("ports", []):
            if port.get("hostPort"):
                out.append(f"{where}: hostPort {port['hostPort']}")
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            if container.get(probe, {}).get("httpGet", {}).get("host"):
                out.append(f"{where}: {probe} host")
    return out


@pytest.mark.parametrize("build", ["deploy", "deploy/cpu"])
def test_every_pod_passes_the_restricted_pod_security_standard(build):
    rendered = pods(render_kustomization(DEPLOY_DIR.parent / build))
    assert {name for name, _ in rendered} >= {"Job/elastic-worker", "Job/etcd-auth", "StatefulSet/etcd"}
    assert {name: restricted_violations(pod) for name, pod in rendered} == {name: [] for name, _ in rendered}


def test_only_the_rdma_overlay_adds_ipc_lock_and_that_is_all_it_breaks():
    rendered = dict(pods(render_kustomization(DEPLOY_DIR / "rdma")))
    assert restricted_violations(rendered.pop("Job/elastic-worker")) == [
        "container worker: adds ['IPC_LOCK'] (baseline and restricted forbid)"]
    assert all(restricted_violations(pod) == [] for pod in rendered.values())


def test_the_checker_sees_what_the_standard_forbids():
    good = {"securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": False,
                                                               "capabilities": {"drop": ["ALL"]}}}],
            "volumes": [{"name": "v", "emptyDir": {}}]}
    assert restricted_violations(good) == []
    bad = {**good, "hostNetwork": True, "volumes": [{"name": "h", "hostPath": {"path": "/"}}],
           "securityContext": {"runAsUser": 0},
           "containers": [{"name": "c", "ports": [{"containerPort": 1, "hostPort": 1}],
                           "securityContext": {"privileged": True, "capabilities": {"add": ["SYS_ADMIN"]}}}]}
    assert len(restricted_violations(bad)) == 11, restricted_violations(bad)
