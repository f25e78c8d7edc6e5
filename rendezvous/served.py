"""The rendezvous a bare-metal job serves itself: an etcd on its own hosts that
survives the loss of any one of them.

The agent on the endpoint's host starts the first member (``first_member``); every
agent of the job then runs a ``ServedRendezvous``: it offers to hold a member (its
address and two ports, on its lease), starts one when invited, and the one elected
steward changes the members as served_plan.decide says, one change at a time: a
member on each of the first three hosts (learners promoted once they have caught
up, where etcd has learners), a lost host's member removed and replaced by another
host's. Every client of this etcd follows its member list (member_sync.py), so the
endpoint's host is no more special than any other once three hosts are in.

Leaving: an agent whose member is not the last voting one removes it before stopping
it, so the members left keep their quorum; the last one stays up until the other
agents have left (the launcher's wait), as the embedded etcd always did.

Security: given the job's secret (job_secret.py; elastic/cli/bare_metal.py decides
when one is required: on anything but loopback), every member serves TLS with a
certificate of the job's CA for its own address, members speak TLS to each other and
accept only peers holding a certificate of that CA (``--peer-client-cert-auth``), and
etcd's auth is on from the first member's start (root and the job's user, as
enable_auth does for Slurm's etcd). Changing the members takes etcd's root role, so the
steward changes them through a client logged in as root (its password derives from
the secret): a process without the secret can neither read the job's keys nor add or
remove a member.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import threading
import time
from typing import Callable, Optional

from . import cluster_rpc
from .election import Election
from .embedded import EmbeddedEtcd
from .errors import RendezvousError
from .etcd import Etcd
from .job_secret import ROOT_USER, JobSecret
from .keys import SERVED_PREFIX
from .member_sync import follow_members
from .private_files import process_dir
from .served_plan import Add, Offer, Promote, Remove, Seat, Wait, decide, initial_cluster
from .session import Session

log = logging.getLogger(__name__)

TICK_S = 1.0  # how often the steward looks at the members (and others at their invitation)
MEMBER_SYNC_S = 2.0  # how often every client of a served etcd re-reads its member list
_START_TIMEOUT_S = 60.0
NAME_PREFIX = "elastic-"


def member_name(host_id: str, addr: str) -> str:
    """An etcd member name: ``elastic-`` (is_served), the host id and the address it
    serves on (two hosts that share a default host name stay apart), in the characters
    ``--initial-cluster`` allows."""
    return NAME_PREFIX + re.sub(r"[^A-Za-z0-9._-]", "-", f"{host_id}-{addr}")


class ServedMember(EmbeddedEtcd):
    """One member of the served etcd on this host, at the ports its offer named."""

    def __init__(self, *, host: str, client_port: int, peer_port: int, name: str,
                 join: Optional[str] = None, log_path: Optional[str] = None,
                 security: Optional[JobSecret] = None):
        """``join``: the ``--initial-cluster`` of a member added to a running cluster;
        None: the first member of a new one. ``security``: the job's secret (TLS to
        clients and peers, auth on); None: plain HTTP without auth."""
        super().__init__(host=host, port=client_port, log_path=log_path, security=security)
        self._name = name
        self._join = join
        self._initial_cluster = join
        self._fixed_peer = peer_port
        self._public = host  # EmbeddedEtcd serves on loopback while it turns auth on; peers never do
        self._peer_tls: tuple[str, ...] = ()
        # A member joining a running cluster finds auth on already (it is the cluster's).
        self._auth_on = join is not None
        # Several members on several hosts: etcd's own raft timers (100 ms, 1 s), not
        # the short ones of a lone member on loopback.
        self._raft_timers = ()

    def start(self, timeout: float = _START_TIMEOUT_S) -> "ServedMember":
        if not self._fixed_peer:
            super().start(timeout)
            return self
        self.binary = self.binary or _binary(self._public)
        import tempfile

        self._work_dir = tempfile.mkdtemp(prefix="elastic-etcd-", dir=process_dir())
        self._data_dir = os.path.join(self._work_dir, "data")
        self._log_path = self._log_path or os.path.join(self._work_dir, "etcd.log")
        self.client_port, self.peer_port = self._fixed_port, self._fixed_peer
        if self.security is not None:
            self._secure(self._work_dir)
        try:
            self._launch(timeout)
        except Exception as exc:
            raise RendezvousError(f"etcd member {self._name} did not start at {self.endpoint}: {exc}") from None
        return self

    def _secure(self, directory: str) -> None:
        super()._secure(directory)
        cert, key = self._tls_args[1], self._tls_args[3]
        # Members accept only peers that hold a certificate of the job's CA.
        self._peer_tls = ("--peer-cert-file", cert, "--peer-key-file", key, "--peer-client-cert-auth",
                          "--peer-trusted-ca-file", self.client_files.ca_cert)

    @property
    def peer_url(self) -> str:
        host = f"[{self._public}]" if ":" in self._public else self._public
        return f"{'https' if self.security is not None else 'http'}://{host}:{self.peer_port}"

    def _command(self) -> list[str]:
        command = super()._command()
        # The peer URL is the public address's, also while the client URL is loopback's
        # (auth being turned on): it is recorded in the data dir at the first start.
        for flag in ("--listen-peer-urls", "--initial-advertise-peer-urls"):
            command[command.index(flag) + 1] = self.peer_url
        if self._join is None:
            command[command.index("--initial-cluster") + 1] = f"{self._name}={self.peer_url}"
        else:
            command[command.index("--initial-cluster-state") + 1] = "existing"
        return [*command, *self._peer_tls]

    def _wait_healthy(self, timeout: float) -> None:
        if self._join is None:
            super()._wait_healthy(timeout)
            return
        # A learner answers no request but Status, and a plain member added to one
        # alone is not healthy before it runs: listening is what we wait for.
        deadline = time.monotonic() + timeout
        while not self._accepts_connections():
            if self._process.poll() is not None or time.monotonic() >= deadline:
                raise RendezvousError(f"exited or not listening within {timeout:g}s: {self._log_tail()}")
            time.sleep(0.05)


def _binary(host: str) -> str:
    from .etcd_binary import find_etcd_binary, warn_if_outdated

    binary = find_etcd_binary()
    warn_if_outdated(binary, host)
    return binary


def first_member(host: str, port: int, host_id: str, log_dir: Optional[str] = None,
                 security: Optional[JobSecret] = None) -> ServedMember:
    """Start the served etcd's first member on ``host:port`` (raises RendezvousError if
    it cannot: another agent of this host bound the port first, or anything else);
    secured with ``security``, the job's secret, if given."""
    name = member_name(host_id, host)
    member = ServedMember(host=host, client_port=port, peer_port=0, name=name, log_path=_log_path(log_dir, name),
                          security=security)
    try:
        return member.start()
    except OSError as exc:
        raise RendezvousError(f"cannot start the job's etcd at {host}:{port}: {exc}") from None


def _log_path(log_dir: Optional[str], name: str) -> Optional[str]:
    if not log_dir:
        return None
    os.makedirs(log_dir, exist_ok=True)
    return os.path.join(log_dir, f"etcd-{name}.log")


def is_served(etcd: Etcd) -> bool:
    """Whether this etcd is one a bare-metal job serves itself: its members are named so
    from their start (a key written after would race the first clients)."""
    return any(m.name.startswith(NAME_PREFIX) for m in cluster_rpc.member_list(etcd))


class ServedRendezvous:
    """This agent's part in the served etcd: offer, hold a member when invited, steer when elected."""

    def __init__(self, etcd: Etcd, host_id: str, addr: str, ttl: float, *,
                 member: Optional[ServedMember] = None, log_dir: Optional[str] = None,
                 free_ports: Optional[Callable[[str], tuple[int, int]]] = None, tick: float = TICK_S,
                 security: Optional[JobSecret] = None):
        """``security``: the job's secret when the served etcd is secured (every member
        this host starts is then, and members are changed as root); None: plain."""
        self._etcd = etcd
        self._security = security
        # Changing members takes etcd's root role once auth is on: a client of its own.
        self._admin = etcd if security is None else follow_members(Etcd(dataclasses.replace(
            etcd.config, user=ROOT_USER, password=security.root_password)))
        self._prefix = SERVED_PREFIX
        self._name = member_name(host_id, addr)
        self._addr = addr
        self._ttl = ttl
        self.member = member  # the one on this host, if any
        self._log_dir = log_dir
        if member is not None:
            self.offer = Offer(self._name, addr, member.client_port, member.peer_port, tls=security is not None)
        else:
            from .embedded import _free_ports

            client, peer = (free_ports or (lambda a: tuple(_free_ports(a, 2))))(addr)
            self.offer = Offer(self._name, addr, client, peer, tls=security is not None)
        self._tick = tick
        # On stop: remove our member from the cluster first (leaving a job that goes on:
        # the others keep their quorum), or not (the job has ended, its agents are gone).
        self.leave_cluster = True
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._session: Optional[Session] = None
        self._said: Optional[str] = None
        self._learners: Optional[bool] = None
        self.actions: list[str] = []  # what this steward did, for logs and tests

    # -- life

    def start(self) -> "ServedRendezvous":
        self._session = Session(self._etcd, self._ttl, on_new_lease=lambda _lease: self._put_offer(),
                                name=f"served-etcd:{self._name}")
        self._put_offer()
        self._thread = threading.Thread(target=self._run, name="served-etcd", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Leave: remove our member if ``leave_cluster`` and others keep the quorum; then
        stop it. The member is stopped by the loop's thread (an invited member dies with
        the thread that started it), which ends here."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._admin is not self._etcd:
            self._admin.close()

    # -- the loop

    def _run(self) -> None:
        election = Election(self._etcd, self._prefix + "steward", self._name, self._session)
        while not self._stop.wait(self._tick):
            try:
                self._answer_invitation()
                if election.campaign() is not None:
                    self._steer()
            except RendezvousError as exc:
                log.debug("served etcd: %s", exc)
            except Exception as exc:  # noqa: BLE001 - the job's etcd must not lose its steward to a surprise
                log.warning("served etcd: %r", exc)
        self._leave_cluster()

    def _put_offer(self) -> None:
        value = {"addr": self.offer.addr, "client_port": self.offer.client_port, "peer_port": self.offer.peer_port,
                 "tls": self.offer.tls}
        self._etcd.put(self._prefix + "offers/" + self._name, json.dumps(value).encode(),
                       lease=self._session.lease_id)

    def _offers(self) -> list[Offer]:
        kvs, _ = self._etcd.get_prefix(self._prefix + "offers/")
        offers = []
        for kv in kvs:
            try:
                value = json.loads(kv.value)
                offers.append(Offer(kv.key.rsplit("/", 1)[1], str(value["addr"]), int(value["client_port"]),
                                    int(value["peer_port"]), kv.create_revision, bool(value.get("tls", False))))
            except (ValueError, KeyError, TypeError):
                log.warning("served etcd: ignoring a malformed offer at %s", kv.key)
        return offers

    def _answer_invitation(self) -> None:
        """Start our member once the steward has added it (never before: etcd refuses it)."""
        if self.member is not None:
            if not self.member.running and self.member.data_dir:
                log.warning("served etcd: member %s exited", self._name)
                self.member = None
            return
        invite = self._etcd.get(self._prefix + "invites/" + self._name)
        if invite is None:
            return
        cluster = json.loads(invite.value)["initial_cluster"]
        if not any(self.offer.peer_url in m.peer_urls for m in cluster_rpc.member_list(self._etcd)):
            return  # invited, not added yet
        log_path = _log_path(self._log_dir, self._name)
        started = time.monotonic()
        member = ServedMember(host=self.offer.addr, client_port=self.offer.client_port,
                              peer_port=self.offer.peer_port, name=self._name, join=cluster, log_path=log_path,
                              security=self._security)
        self.member = member.start()
        log.info("served etcd: member %s started at %s in %.2fs (cluster %s)", self._name, member.endpoint,
                 time.monotonic() - started, cluster)

    def _steer(self) -> None:
        if self._learners is None:
            # Learners since etcd 3.4 (MemberAdd isLearner, MemberPromote: seen working on 3.4.23 and 3.5.1).
            self._learners = cluster_rpc.server_version(self._etcd) >= (3, 4)
        members = cluster_rpc.member_list(self._etcd)
        seats = [Seat(m.id, m.name, m.peer_urls[0] if m.peer_urls else "", m.is_learner) for m in members]
        offers = self._offers()
        action = decide(seats, offers, learners=self._learners)
        if isinstance(action, Wait):
            if action.why != self._said:
                log.info("served etcd: %s", action.why)
                self._said = action.why
            return
        started = time.monotonic()
        if isinstance(action, Add):
            invite = {"initial_cluster": initial_cluster(seats, action.offer)}
            # The invitation first: a plain member added to a lone one takes the quorum
            # with it until it runs, and nothing could be written in between.
            self._etcd.put(self._prefix + "invites/" + action.offer.host_id, json.dumps(invite).encode())
            try:
                cluster_rpc.member_add(self._admin, action.offer.peer_url, learner=action.learner)
            except RendezvousError:
                self._etcd.delete(self._prefix + "invites/" + action.offer.host_id)
                raise
            what = f"added {action.offer.host_id} ({action.offer.client_url})" + (" as a learner" if action.learner else "")
        elif isinstance(action, Promote):
            try:
                cluster_rpc.member_promote(self._admin, action.member_id)
            except RendezvousError as exc:
                log.debug("served etcd: %s not promoted yet: %s", action.name, exc)
                return
            what = f"promoted {action.name}"
        else:
            assert isinstance(action, Remove)
            cluster_rpc.member_remove(self._admin, action.member_id)
            gone = next((s for s in seats if s.id == action.member_id), None)
            if gone is not None and gone.name:
                self._etcd.delete(self._prefix + "invites/" + gone.name)
            what = f"removed: {action.why}"
        self.actions.append(what)
        log.info("served etcd: %s in %.2fs", what, time.monotonic() - started)

    def _leave_cluster(self) -> None:
        if self._session is not None:
            self._session.close()  # our offer goes: no steward invites us again
        member, self.member = self.member, None
        if member is None:
            return
        if not self.leave_cluster:
            member.stop()
            return
        try:
            members = cluster_rpc.member_list(self._etcd, deadline=3.0)
            ours = next((m for m in members if m.name == self._name), None)
            voting = [m for m in members if m.started and not m.is_learner and m is not ours]
            if ours is not None and voting:
                cluster_rpc.member_remove(self._admin, ours.id, deadline=5.0)
                log.info("served etcd: member %s removed on leaving (%d left)", self._name, len(voting))
        except RendezvousError as exc:
            log.info("served etcd: member %s not removed on leaving: %s", self._name, exc)
        member.stop()

