"""deploy/try-kind.sh, the Kubernetes try-out, run here with fake docker, kind and kubectl
on PATH that record their calls (no cluster can run on this machine): it builds the CPU
image, creates the cluster, loads the image, creates both Secrets before applying, applies
the real rendering of deploy/kind (kubectl kustomize is the real one) and waits for the
Job; every kubectl call but the rendering names the kind cluster's context."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from cryptography import x509

from tests.fakes.pods import kubectl_binary

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "try-kind.sh"

_FAKE = """#!/bin/sh
echo "$(basename "$0") $*" >> "$FAKES/calls"
exec "$FAKES/behave" "$(basename "$0")" "$@"
"""
_BEHAVE = """#!/usr/bin/env bash
tool=$1; shift
args=" $* "
case "$tool" in
  kind) [[ "$args" == *" get clusters "* ]] && exit 0; exit 0 ;;
  docker) exit 0 ;;
  kubectl)
    [[ "$1" == kustomize ]] && exec "$REAL_KUBECTL" "$@"
    [[ "$args" == *" get secret "* ]] && exit 1
    if [[ "$args" == *" create secret generic "* ]]; then
      for a in "$@"; do case "$a" in --from-file=*) cp "${a#--from-file=}" "$FAKES/";; esac; done
      exit 0
    fi
    if [[ "$args" == *" apply -f "* ]]; then
      prev=""; for a in "$@"; do [[ "$prev" == -f ]] && cp "$a" "$FAKES/applied.yaml"; prev=$a; done
      exit 0
    fi
    exit 0 ;;
esac
"""


def _fakes(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("docker", "kind", "kubectl"):
        (bin_dir / tool).write_text(_FAKE)
        (bin_dir / tool).chmod(0o755)
    (tmp_path / "behave").write_text(_BEHAVE)
    (tmp_path / "behave").chmod(0o755)
    return bin_dir


def _run(tmp_path: Path, path: str):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KIND_", "NAMESPACE", "KEEP_"))}
    env.update(PATH=path, FAKES=str(tmp_path), REAL_KUBECTL=kubectl_binary())
    return subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_try_kind_builds_loads_creates_the_secrets_applies_and_waits(tmp_path):
    bin_dir = _fakes(tmp_path)
    done = _run(tmp_path, f"{bin_dir}:{os.environ['PATH']}")
    assert done.returncode == 0, done.stdout + done.stderr
    calls = [shlex.split(line) for line in (tmp_path / "calls").read_text().splitlines()]
    steps = [" ".join(c) for c in calls]
    build = next(c for c in calls if c[:2] == ["docker", "build"])
    assert build[build.index("-f") + 1] == "deploy/Dockerfile" and "TORCH_VARIANT=cpu" in build
    image = build[build.index("-t") + 1]
    order = [next(i for i, s in enumerate(steps) if s.startswith(prefix)) for prefix in (
        "docker build", "kind create cluster --name elastic-run", f"kind load docker-image {image} --name elastic-run")]
    assert order == sorted(order)
    kubectl = [c for c in calls if c[0] == "kubectl"]
    assert all(c[1:3] == ["--context", "kind-elastic-run"] for c in kubectl if c[1] != "kustomize")
    secrets = [i for i, s in enumerate(steps) if " create secret generic " in s]
    applied = next(i for i, s in enumerate(steps) if " apply -f " in s)
    waited = next(i for i, s in enumerate(steps) if "wait --for=condition=complete job/elastic-worker" in s)
    assert len(secrets) == 2 and max(secrets) < applied < waited and order[-1] < applied
    assert "kubectl kustomize deploy/kind" in steps

    # The certificate the Secret holds: signed by its CA, for the names etcd is reached at.
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    cert = x509.load_pem_x509_certificate((tmp_path / "tls.crt").read_bytes())
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert {"etcd-client", "etcd-client.default.svc", "*.etcd-peers.default.svc"} <= set(names)
    assert (tmp_path / "tls.key").exists()

    # What was applied: deploy/cpu's job with the image just built, a volume kind can provide,
    # and the Secrets the pods mount are the ones created.
    docs = [d for d in yaml.safe_load_all((tmp_path / "applied.yaml").read_text()) if d]
    job = next(d for d in docs if d["kind"] == "Job" and d["metadata"]["name"] == "elastic-worker")
    assert {c["image"] for c in job["spec"]["template"]["spec"]["containers"]} == {image}
    pvc = next(d for d in docs if d["kind"] == "PersistentVolumeClaim" and d["metadata"]["name"] == "elastic-shared")
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert set(_secrets_used(docs)) == {"etcd-tls", "etcd-auth"}


def _secrets_used(node):
    """The Secret names a manifest refers to (volumes, projected sources, env references)."""
    if isinstance(node, dict):
        if isinstance(node.get("secretName"), str):
            yield node["secretName"]
        for key, value in node.items():
            if key in ("secret", "secretKeyRef", "secretRef") and isinstance(value, dict) and "name" in value:
                yield value["name"]
            yield from _secrets_used(value)
    elif isinstance(node, list):
        for item in node:
            yield from _secrets_used(item)


def test_try_kind_names_a_missing_tool_in_one_line(tmp_path):
    bin_dir = _fakes(tmp_path)
    (bin_dir / "kind").unlink()
    done = _run(tmp_path, f"{bin_dir}:/usr/bin:/bin")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "try-kind: kind not found on PATH (this script needs docker, kind, kubectl and openssl)"]
