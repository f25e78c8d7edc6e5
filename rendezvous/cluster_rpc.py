"""Who the etcd cluster's members are, and adding, promoting and removing them.

etcd's cluster API (``etcdserverpb.Cluster``) as the rendezvous that a bare-metal job
serves itself needs it (served.py). The ``etcd3`` library's messages predate learners
(no ``isLearner``, no ``MemberPromote``), so the few messages used here are declared
below from etcd's ``rpc.proto`` (same names and field numbers) and sent through the
client's own retry and failover policy (``Etcd.call``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional
from urllib.parse import urlsplit

import grpc
from etcd3 import etcdrpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from .etcd import Etcd

_SERVICE = "/etcdserverpb.Cluster/"


def _messages() -> dict:
    """Member, MemberList/Add/Remove/Promote requests and responses (header left out:
    a field a message does not declare is skipped when read)."""
    proto = descriptor_pb2.FileDescriptorProto(name="elastic_etcd_cluster.proto", package="elastic_etcd_cluster",
                                               syntax="proto3")
    string, uint64, boolean = (descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
                               descriptor_pb2.FieldDescriptorProto.TYPE_UINT64,
                               descriptor_pb2.FieldDescriptorProto.TYPE_BOOL)
    message = descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE
    repeated, optional = (descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED,
                          descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)

    def declare(name: str, *fields) -> None:
        msg = proto.message_type.add(name=name)
        for number, spec in enumerate(fields, start=1):
            if spec is None:
                continue  # a field number we do not read (the response header)
            field, kind, label = spec
            extra = {"type_name": ".elastic_etcd_cluster.Member"} if kind == message else {}
            msg.field.add(name=field, number=number, type=kind, label=label, **extra)

    declare("Member", ("ID", uint64, optional), ("name", string, optional), ("peerURLs", string, repeated),
            ("clientURLs", string, repeated), ("isLearner", boolean, optional))
    declare("MemberListRequest", ("linearizable", boolean, optional))
    declare("MemberListResponse", None, ("members", message, repeated))
    declare("MemberAddRequest", ("peerURLs", string, repeated), ("isLearner", boolean, optional))
    declare("MemberAddResponse", None, ("member", message, optional), ("members", message, repeated))
    declare("MemberRemoveRequest", ("ID", uint64, optional))
    declare("MemberRemoveResponse", None, ("members", message, repeated))
    declare("MemberPromoteRequest", ("ID", uint64, optional))
    declare("MemberPromoteResponse", None, ("members", message, repeated))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return {m.name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"elastic_etcd_cluster.{m.name}"))
            for m in proto.message_type}


_MSG = _messages()


@dataclass(frozen=True)
class ClusterMember:
    """One member as etcd lists it. A member added but not started yet has no name
    and no client URLs."""

    id: int
    name: str
    peer_urls: tuple[str, ...]
    client_urls: tuple[str, ...]
    is_learner: bool = False

    @property
    def started(self) -> bool:
        return bool(self.name)

    def client_endpoints(self) -> tuple[tuple[str, int], ...]:
        return tuple(_host_port(url) for url in self.client_urls)


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "", parts.port or 2379


def _member(raw) -> ClusterMember:
    return ClusterMember(raw.ID, raw.name, tuple(raw.peerURLs), tuple(raw.clientURLs), bool(raw.isLearner))


def _rpc(etcd: Etcd, method: str, request, response: str, deadline: Optional[float]):
    def rpc(channel: grpc.Channel, timeout: float, metadata: tuple):
        call = channel.unary_unary(_SERVICE + method, request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=_MSG[response].FromString)
        return call(request, timeout=timeout, metadata=metadata)

    return etcd.call(f"member {method[6:].lower()}", rpc, deadline=deadline)


def member_list(etcd: Etcd, *, deadline: Optional[float] = None) -> list[ClusterMember]:
    reply = _rpc(etcd, "MemberList", _MSG["MemberListRequest"](), "MemberListResponse", deadline)
    return [_member(m) for m in reply.members]


def member_add(etcd: Etcd, peer_url: str, *, learner: bool, deadline: Optional[float] = None) -> ClusterMember:
    request = _MSG["MemberAddRequest"](peerURLs=[peer_url], isLearner=learner)
    return _member(_rpc(etcd, "MemberAdd", request, "MemberAddResponse", deadline).member)


def member_remove(etcd: Etcd, member_id: int, *, deadline: Optional[float] = None) -> None:
    _rpc(etcd, "MemberRemove", _MSG["MemberRemoveRequest"](ID=member_id), "MemberRemoveResponse", deadline)


def member_promote(etcd: Etcd, member_id: int, *, deadline: Optional[float] = None) -> None:
    _rpc(etcd, "MemberPromote", _MSG["MemberPromoteRequest"](ID=member_id), "MemberPromoteResponse", deadline)


def server_version(etcd: Etcd, *, deadline: Optional[float] = None) -> tuple[int, int]:
    """(major, minor) of the etcd server answering now."""
    reply = etcd.call("status", lambda ch, t, md: etcdrpc.MaintenanceStub(ch).Status(
        etcdrpc.StatusRequest(), timeout=t, metadata=md), deadline=deadline)
    major, minor = (reply.version.split(".") + ["0", "0"])[:2]
    return int(major), int(minor)
