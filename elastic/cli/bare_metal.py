"""torchrun's multi-node launch on bare metal: the host at ``--rdzv-endpoint`` serves the rendezvous.

Every host runs the same command (``--rdzv-endpoint node0:29400 --job-id job42 ...``).
When no etcd answers at the endpoint, the agent whose own address is the endpoint's
host starts the job's etcd there, on that address (the job's network, never loopback),
and every other agent waits for it within ``--rdzv-timeout``. Once it answers, each
agent takes part in it (rendezvous/served.py): from three hosts on, the etcd has a
member on three of them, so the endpoint's host may be lost like any other. Below
three hosts its one member's host is a single point of failure, said once at start.

"My own address": the endpoint's host, or any address its name resolves to, is one
this host can bind (an address of one of its interfaces, secondary and IPv6 ones
included). A name that resolves to loopback on its own host (Debian's 127.0.1.1) is
taken as this host only with an explicit ``--host-addr``, which is then served on.
Two agents of one host both match: both try, the bind decides, the other uses it.
A loopback endpoint (127.0.0.1, localhost) is served only with ``--rdzv-backend c10d``
(torchrun's ``--rdzv-backend=c10d --rdzv-endpoint=localhost:29400`` on one host): as
torchrun's c10d store, by the first agent that finds the port free (an embedded etcd
on loopback, this machine's processes only); the others use it. Otherwise a loopback
endpoint is a test's or a single host's own etcd, which must answer there.

Secured by default (``served_security``): every host is given the same job secret
(``--job-secret-file FILE`` or ``ELASTIC_JOB_SECRET_FILE``, a 0600 file; or the secret
itself in ``ELASTIC_JOB_SECRET``), as Slurm's batch script hands one to its steps, and
the served etcd runs with TLS (clients and peers) and auth from it. Why a file the user
copies and not one the endpoint's host generates: bare-metal hosts share no directory
and no channel that only the job can read; anything the endpoint's host could publish
to the others, a stranger on the network could read too. Without a secret, a served
etcd off loopback is refused in one line naming the fix, unless ``--allow-insecure``
(one warning line). A host without the secret that finds the endpoint speaking TLS is
told to get the secret, at once; a host with it that finds a listener whose certificate
is not the job's CA's is refused (a squatter on the port), never followed.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from elastic.rendezvous import ConfigError, EmbeddedEtcd, Etcd, EtcdConfig, RendezvousError
from elastic.rendezvous.served import ServedMember, first_member, is_served
from elastic.rendezvous.tls_probe import TlsFiles, tls_refusal

log = logging.getLogger(__name__)

PROBE_S = 2.0  # how long the first look for an etcd at the endpoint waits


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address.lower() == "localhost"


@dataclass(frozen=True)
class ServedSecurity:
    """Whether a served etcd member on some address runs with the job's secret, and
    the one warning line to print when it does not where it should."""

    secure: bool
    warning: Optional[str] = None


NO_SECRET = ("the job's etcd would be served on {address} without TLS or authentication, open to anyone who "
             "can reach it: give every host the same secret file (`openssl rand -hex 32 > job.secret; chmod 600 "
             "job.secret`, copy it to each host, then --job-secret-file job.secret), or --allow-insecure on a "
             "network only the job can reach")
INSECURE = ("--allow-insecure: the job's etcd on {address} runs without TLS or authentication: anyone who can "
            "reach it can read, join or end the job")


def served_security(address: str, has_secret: bool, allow_insecure: bool) -> ServedSecurity:
    """The decision for a served etcd member on ``address`` (every host that holds one
    decides the same way). Raises ConfigError (one line, naming the fix) where a member
    off loopback would run without the job's secret and --allow-insecure was not given."""
    if has_secret:
        return ServedSecurity(True)
    if _loopback(address):
        return ServedSecurity(False)  # this machine's own processes only, as the embedded etcd always was
    if allow_insecure:
        return ServedSecurity(False, INSECURE.format(address=address))
    raise ConfigError(NO_SECRET.format(address=address))


def speaks_tls(host: str, port: int, timeout: float = 2.0) -> bool:
    """Whether the listener at ``host:port`` completes a TLS handshake (whatever its certificate)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # only asking whether it speaks TLS at all
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw:
            with context.wrap_socket(raw, server_hostname=host):
                return True
    except (OSError, ssl.SSLError):
        return False


def serving_address(endpoint_host: str, resolved: Sequence[str], is_local: Callable[[str], bool],
                    host_addr: Optional[str]) -> Optional[str]:
    """The address this host serves the rendezvous on, or None if the endpoint is
    another host's. ``resolved``: what ``endpoint_host`` resolves to here;
    ``host_addr``: an explicit ``--host-addr`` (None if not given). Raises
    ConfigError where the answer cannot be known."""
    if _loopback(endpoint_host):
        return None
    routable = [a for a in resolved if not _loopback(a)]
    for address in routable:
        if is_local(address):
            return address
    if resolved and not routable:
        # The name resolves to loopback here only: Debian's "127.0.1.1 <hostname>". It
        # is this host; which of its addresses the others reach, only --host-addr says.
        if host_addr and not _loopback(host_addr) and is_local(host_addr):
            return host_addr
        raise ConfigError(f"--rdzv-endpoint {endpoint_host} resolves to {resolved[0]} (loopback) on this host: "
                          "give --host-addr with the address the other hosts reach it at, or give the endpoint "
                          "as that address")
    return None


def resolve(host: str) -> list[str]:
    try:
        return list(dict.fromkeys(info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)))
    except OSError:
        return []


def bindable(address: str) -> bool:
    """Whether ``address`` is one of this host's (bind to it succeeds; EADDRNOTAVAIL: not ours)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((address, 0))
        return True
    except OSError:
        return False


def _answers(config: EtcdConfig, timeout: float) -> bool:
    with Etcd(config) as etcd:
        try:
            etcd.check(timeout=timeout)
            return True
        except RendezvousError:
            return False


def wait_for_rendezvous(config: EtcdConfig, timeout: float) -> None:
    """Until an etcd answers at ``config``'s endpoint (the host there starts it), within ``timeout``."""
    deadline = time.monotonic() + timeout
    log.info("waiting up to %.0f s for the rendezvous at %s (the host at that address serves it)",
             timeout, config.describe())
    while not _answers(config, min(PROBE_S, max(0.1, deadline - time.monotonic()))):
        _check_listener(config)
        if time.monotonic() >= deadline:
            raise RendezvousError(f"no rendezvous answered at {config.describe()} within --rdzv-timeout "
                                  f"{timeout:g}s: is elastic-run started on that host, and is the port open?")
        time.sleep(0.2)


def _check_listener(config: EtcdConfig) -> None:
    """A listener at the endpoint that is not one we can use, said at once: a secured
    etcd while this host has no secret, or (with the secret) one whose certificate is
    not the job's CA's: a squatter, or a job of another secret."""
    (host, port), = config.endpoints
    if config.ca_cert is None:
        if speaks_tls(host, port):
            raise ConfigError(f"the rendezvous at {host}:{port} is secured (TLS) and this host has no job secret: "
                              f"give it the same secret file as the host at {host} (--job-secret-file FILE)")
        return
    refusal = tls_refusal(host, port, TlsFiles(config.ca_cert), timeout=2.0)
    if refusal is not None:
        raise RendezvousError(f"the listener at {host}:{port} is not this job's etcd, refused: {refusal} (another "
                              f"process on the port, or a host given another --job-secret-file?)")


@dataclass(frozen=True)
class Arrival:
    """How this agent found the rendezvous: ``member``, the first member it started
    (this host is the endpoint's), or None; ``waited``: no etcd answered at first."""

    member: Optional[ServedMember] = None
    waited: bool = False
    candidate: bool = True  # False: a loopback endpoint, a list, Slurm's: never a served etcd
    local: Optional[EmbeddedEtcd] = None  # --rdzv-backend c10d on loopback: the one this agent serves


def serve_or_wait(args: argparse.Namespace, config: EtcdConfig, host_id: str, log_dir: Optional[str]) -> Arrival:
    """main's hook for a single non-loopback ``--rdzv-endpoint``: start the first member
    of the job's etcd when this host is the endpoint's and none answers there; else
    wait until one answers."""
    if len(config.endpoints) != 1 or getattr(args, "slurm_rendezvous", None) is not None:
        return Arrival(candidate=False)  # a list (the user's own cluster), or Slurm's own arrangement
    host, port = config.endpoints[0]
    if _loopback(host):
        if getattr(args, "rdzv_backend", "etcd") != "c10d":
            return Arrival(candidate=False)
        return _serve_on_loopback_or_wait(args, config, host, port, log_dir)
    if _answers(config, PROBE_S):
        return Arrival()
    address = serving_address(host, resolve(host), bindable, args.host_addr)
    if address is not None:
        js = getattr(args, "job_secret", None)
        security = served_security(address, js is not None, bool(getattr(args, "allow_insecure", False)))
        if security.warning:
            log.warning("%s", security.warning)
        try:
            member = first_member(address, port, host_id, log_dir, security=js if security.secure else None)
        except RendezvousError as exc:
            # Another agent of this host bound the port first (or the port is taken):
            # the one that bound it serves; we use it like everyone else.
            log.info("not serving the rendezvous at %s:%d here (%s): waiting for the one that does",
                     address, port, exc)
        else:
            return Arrival(member)
    wait_for_rendezvous(config, args.rdzv_timeout)
    return Arrival(waited=True)


def _loopback_address(host: str) -> str:
    return "127.0.0.1" if host.lower() == "localhost" else host.strip("[]")


def port_is_free(address: str, port: int) -> bool:
    """Whether nothing listens on ``address:port`` (a bind succeeds, as etcd's will, with SO_REUSEADDR)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError:
            return False
    return True


def _serve_on_loopback_or_wait(args: argparse.Namespace, config: EtcdConfig, host: str, port: int,
                               log_dir: Optional[str]) -> Arrival:
    """torchrun's c10d store on one host: the first agent that finds the port free serves
    the rendezvous there; every other agent waits until it answers (within --rdzv-timeout)."""
    address = _loopback_address(host)
    if port_is_free(address, port):
        log_path = os.path.join(log_dir, "etcd-rendezvous.log") if log_dir else None
        try:
            served = EmbeddedEtcd(host=address, port=port, log_path=log_path).start()
        except RendezvousError as exc:  # another agent bound it between our look and etcd's bind
            log.info("not serving the rendezvous at %s:%d here (%s): waiting for the one that does", host, port, exc)
        else:
            log.info("serving the rendezvous at %s:%d (--rdzv-backend c10d: the first agent to find the port free "
                     "serves it); other agents of this host join with the same command", host, port)
            return Arrival(candidate=False, local=served)
    wait_for_rendezvous(config, args.rdzv_timeout)
    return Arrival(waited=True, candidate=False)


def served_here(etcd: Etcd, arrival: Arrival) -> bool:
    """Whether the job's etcd is one a host of the job serves (started here, or its
    members named so): then this agent takes part in it."""
    if arrival.member is not None:
        return True
    try:
        return arrival.candidate and is_served(etcd)
    except RendezvousError:
        return False  # an etcd that will not list its members to us is not one we serve


def spof_note(endpoint: str) -> str:
    return (f"the job's rendezvous (etcd) runs on this host ({endpoint}) alone until three hosts have joined: "
            "losing this host before then ends the job; from three hosts on, any one host may be lost")
