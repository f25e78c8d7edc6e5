#!/usr/bin/env bash
# Try elastic-run on Kubernetes, on this machine: build the CPU image, start (or reuse) a
# kind cluster, load the image into it, create the two Secrets etcd needs (a CA and a
# certificate made with openssl, two random passwords: docs/kubernetes-security.md),
# apply deploy/kind (deploy/cpu with a volume kind can provide) and wait until the
# training Job completes: 3 pods of one worker each train examples/digits.py with gloo.
#
#   deploy/try-kind.sh            # needs docker, kind, kubectl and openssl on PATH
#
# Settings (environment): KIND_CLUSTER (default elastic-run), NAMESPACE (default), TIMEOUT
# (how long to wait for the Job, default 30m), KEEP_CLUSTER=0 deletes the cluster at the
# end (only one this script created). Every kubectl call names the kind cluster's context,
# so your current context is left alone. Run it again: the cluster, image and Secrets are
# reused; delete them with `kind delete cluster --name elastic-run`.
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER=${KIND_CLUSTER:-elastic-run}
NS=${NAMESPACE:-default}
TIMEOUT=${TIMEOUT:-30m}
IMAGE=elastic-run:0.1.0-cpu  # deploy/cpu/kustomization.yaml's image
CONTEXT=kind-$CLUSTER
say() { echo "try-kind: $*"; }
for tool in docker kind kubectl openssl; do
    command -v "$tool" >/dev/null 2>&1 || { echo "try-kind: $tool not found on PATH (this script needs docker, kind, kubectl and openssl)" >&2; exit 2; }
done
k() { kubectl --context "$CONTEXT" -n "$NS" "$@"; }

say "1/6 building $IMAGE (deploy/Dockerfile, TORCH_VARIANT=cpu)"
docker build -f deploy/Dockerfile --build-arg TORCH_VARIANT=cpu -t "$IMAGE" .

created=0
if kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
    say "2/6 reusing the kind cluster $CLUSTER"
else
    say "2/6 creating the kind cluster $CLUSTER"
    kind create cluster --name "$CLUSTER" --wait 120s
    created=1
fi

say "3/6 loading $IMAGE into $CLUSTER"
kind load docker-image "$IMAGE" --name "$CLUSTER"

if k get secret etcd-tls >/dev/null 2>&1 && k get secret etcd-auth >/dev/null 2>&1; then
    say "4/6 the Secrets etcd-tls and etcd-auth exist in $NS: kept"
else
    say "4/6 creating the Secrets etcd-tls and etcd-auth in $NS"
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    (
        cd "$work"
        openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 3650 \
            -subj "/CN=elastic-etcd-ca" -keyout ca.key -out ca.crt 2>/dev/null
        openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=etcd" \
            -keyout tls.key -out tls.csr 2>/dev/null
        printf '%s\n' "subjectAltName=DNS:etcd-client,DNS:etcd-client.$NS.svc,DNS:*.etcd-peers.$NS.svc,DNS:localhost,IP:127.0.0.1" \
            "extendedKeyUsage=serverAuth,clientAuth" > san.ext
        openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
            -extfile san.ext -out tls.crt 2>/dev/null
    )
    k delete secret etcd-tls etcd-auth --ignore-not-found >/dev/null
    k create secret generic etcd-tls --from-file="$work/tls.crt" --from-file="$work/tls.key" --from-file="$work/ca.crt"
    k create secret generic etcd-auth --from-literal=root-password="$(openssl rand -hex 24)" \
        --from-literal=elastic-password="$(openssl rand -hex 24)"
fi

say "5/6 applying deploy/kind (deploy/cpu: 3 etcd members, 3 worker pods)"
rendered=$(mktemp)
kubectl kustomize deploy/kind > "$rendered"
k apply -f "$rendered"
rm -f "$rendered"

say "6/6 waiting up to $TIMEOUT for job/elastic-worker to complete (kubectl --context $CONTEXT get pods -w to watch)"
if ! k wait --for=condition=complete job/elastic-worker --timeout="$TIMEOUT"; then
    echo "try-kind: job/elastic-worker did not complete within $TIMEOUT; its pods and their last lines:" >&2
    k get pods -o wide >&2 || true
    k logs -l app.kubernetes.io/name=elastic-worker --prefix --tail 20 >&2 || true
    exit 1
fi
say "job/elastic-worker completed: the digits job trained on kind"
if [ "${KEEP_CLUSTER:-1}" = 0 ] && [ "$created" = 1 ]; then
    kind delete cluster --name "$CLUSTER"
fi
