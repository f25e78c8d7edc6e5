"""``python -m elastic.cli.etcd_auth``: turn on authentication in a deployed etcd, once.

Kubernetes' etcd (deploy/etcd) starts with TLS but, as every etcd, without users: auth
can only be enabled through its API. The Job deploy/workers/etcd-auth-job.yaml runs this
with the passwords of the ``etcd-auth`` Secret (docs/kubernetes-security.md): it creates
``root`` and the workers' user (read/write on ``/elastic/`` only) and enables auth. An etcd
whose auth is on already is left as it is, so running it again is harmless. Until etcd
answers it retries (``--wait``); a wrong CA or a refused handshake is one line, exit 1.
"""

from __future__ import annotations

import argparse
import sys
import time

import grpc

from elastic.rendezvous import ConfigError, EtcdConfig
from elastic.rendezvous.job_secret import JOB_USER, enable_auth, read_private_file


def main(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m elastic.cli.etcd_auth", description=__doc__.splitlines()[0])
    p.add_argument("--endpoint", required=True, help="https://HOST:PORT of the etcd")
    p.add_argument("--ca", required=True, help="the CA that signed etcd's certificate")
    p.add_argument("--root-password-file", required=True)
    p.add_argument("--user", default=JOB_USER)
    p.add_argument("--password-file", required=True, help="the workers' password (ELASTIC_ETCD_PASSWORD_FILE)")
    p.add_argument("--wait", type=float, default=600.0, help="seconds to wait for etcd to answer")
    args = p.parse_args(argv)
    try:
        (host, port), = EtcdConfig.from_string(args.endpoint).endpoints
        ca = open(args.ca, "rb").read()
        root = read_private_file(args.root_password_file, "root password file")
        password = read_private_file(args.password_file, "password file")
    except (ConfigError, OSError, ValueError) as exc:
        print(f"etcd_auth: error: {exc}", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.wait
    while True:
        try:
            done = enable_auth(f"{host}:{port}", None, ca, root_password=root, user=args.user, password=password)
            print(f"etcd_auth: {'auth enabled' if done else 'auth was on already'} at {host}:{port}")
            return 0
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                print(f"etcd_auth: etcd at {host}:{port}: {exc.code().name}: {exc.details()}", file=sys.stderr)
                return 1
            time.sleep(2.0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
