"""Which address this host's workers are reached at, and which interface holds it.

gloo (and NCCL's socket transport) do not use ``--host-addr``: unless told an
interface, they advertise the address that the host *name* resolves to, which is
127.0.0.1 or 127.0.1.1 on many hosts, and peers on other hosts then fail in
``connectFullMesh``. So the agent:

* takes as the default ``--host-addr`` the local address of the route to etcd
  (every host of a job reaches etcd, so that route is the one the job's network
  uses); with the embedded etcd everything is on this host: 127.0.0.1;
* gives its workers ``GLOO_SOCKET_IFNAME`` (and ``NCCL_SOCKET_IFNAME`` with NCCL, as
  an exact match "=eth0") = the interface that holds ``--host-addr``, unless the user
  set them already.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import socket
import struct
from typing import Mapping, Optional

from ..contract.devices import uses_nccl

LOOPBACK = "127.0.0.1"
_SIOCGIFADDR = 0x8915  # linux/sockios.h: the IPv4 address of an interface
_IFNAMSIZ = 16


def route_source(host: str, port: int) -> Optional[str]:
    """The local address this host uses to reach host:port, or None if there is no route.

    ``connect`` on a UDP socket only picks the route and the source address: no
    packet is sent, so this works before etcd answers and through any firewall.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.connect(sockaddr)
                return sock.getsockname()[0]
        except OSError:
            continue
    return None


def default_host_addr(etcd_endpoint: Optional[tuple[str, int]], host_name: str) -> str:
    """``--host-addr`` when none is given: the route to etcd; loopback for the embedded etcd;
    the host name's resolution only if etcd's address cannot be routed (etcd then fails anyway)."""
    if etcd_endpoint is None:
        return LOOPBACK
    source = route_source(*etcd_endpoint)
    if source is not None:
        return source
    try:
        return socket.gethostbyname(host_name)
    except OSError:
        return host_name


def _ipv4_of(ifname: str) -> Optional[str]:
    request = struct.pack("256s", ifname.encode()[: _IFNAMSIZ - 1])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
        except OSError as exc:
            if exc.errno in (errno.EADDRNOTAVAIL, errno.ENODEV, errno.EINVAL):
                return None  # no IPv4 address on it, or it vanished meanwhile
            raise
    return socket.inet_ntoa(reply[20:24])  # ifr_addr: sockaddr_in after the 16-byte name


def _ipv6_interfaces(addr: ipaddress.IPv6Address) -> list[str]:
    """Interfaces holding an IPv6 address, from /proc/net/if_inet6 (one address per line)."""
    try:
        with open("/proc/net/if_inet6") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    return [fields[5] for fields in (line.split() for line in lines)
            if len(fields) >= 6 and ipaddress.IPv6Address(int(fields[0], 16)) == addr]


def interface_holding(addr: str) -> Optional[str]:
    """The name of the local interface that holds ``addr``, or None (a NAT'ed or
    foreign address, or a host name that is not an address at all)."""
    try:
        wanted = ipaddress.ip_address(addr)
    except ValueError:
        return None
    if isinstance(wanted, ipaddress.IPv6Address):
        names = _ipv6_interfaces(wanted)
        return names[0] if names else None
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == addr:
            return name
    if wanted.is_loopback:
        # 127.0.1.1 (Debian's host-name address) and friends are held by lo's 127.0.0.0/8
        # without being its primary address.
        return next((name for _, name in socket.if_nameindex() if _ipv4_of(name) == LOOPBACK), None)
    return None


def socket_ifname_vars(backend: str) -> tuple[str, ...]:
    """The variables that pick the interface of ``backend``'s sockets."""
    return ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if uses_nccl(backend) else ("GLOO_SOCKET_IFNAME",)


def socket_ifname_env(ifname: Optional[str], backend: str, environ: Mapping[str, str]) -> dict[str, str]:
    """What to add to a worker's environment: the interface for every variable the
    user has not set himself (theirs win). NCCL reads its variable as a list of name
    prefixes ("eth1" would also pick "eth10"): "=eth1" asks for that interface exactly.
    This ties NCCL's socket transport (bootstrap, and data when there is no IB/RoCE/EFA)
    to the interface on the route to etcd; on hosts whose fast network is another
    interface, set NCCL_SOCKET_IFNAME (and NCCL_IB_HCA) yourself."""
    if ifname is None:
        return {}
    exact = {"GLOO_SOCKET_IFNAME": ifname, "NCCL_SOCKET_IFNAME": f"={ifname}"}
    return {var: exact[var] for var in socket_ifname_vars(backend) if not environ.get(var)}
