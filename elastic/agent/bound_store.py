"""The agent's TCPStore servers, listening on the job's address (--host-addr) only.

torch's TCPStore server binds the wildcard address whatever host it is given (the
libuv backend ``::`` with an IPv4 fallback), so a round's store was reachable on
every interface of the host, loopback-only jobs included, and it has no
authentication: one ``set`` from anywhere could stop or fail the job (security
review, finding 2). The server can instead take a socket that is already
listening (``master_listen_fd``; torch 2.13 with libuv: checked, it serves on it
and closes it when the store is destroyed), so the socket is bound here, to the
address the job's peers use, and handed over.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist


def listening_socket(host_addr: str) -> socket.socket:
    """A TCP socket listening on ``host_addr`` at a port the kernel picks."""
    family, kind, proto, _, address = socket.getaddrinfo(host_addr, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def serve(host_addr: str, timeout_s: float) -> dist.TCPStore:
    """A TCPStore server that only ``host_addr`` reaches; its ``port`` as usual."""
    sock = listening_socket(host_addr)
    port = sock.getsockname()[1]
    fd = sock.detach()  # the store owns it from here (it closes it when destroyed)
    try:
        return dist.TCPStore(host_addr, port, is_master=True, wait_for_workers=False, master_listen_fd=fd,
                             timeout=datetime.timedelta(seconds=timeout_s))
    except BaseException:
        os.close(fd)
        raise
