"""The shard adapter of the "tcp" channel: pull, push and push-pull with their tensors in the frames
of the shard's framed data connection (asyncps.net.framed), on the shard's one ShardService.

TcpAdapter (the registry's factory, built from ShardSide by asyncps.ps.main) offers its three
request kinds on ShardSide beside every other channel's (shm's doorbell), answers DataPort and
runs the data port's listener (start, close) over all the kinds offered, because the port is its
shard setting: data_port (`asyncps ps --data-port`, declared in its registry entry; 0: any free port;
-1: none, DataPort answers 0 and workers fall back to gRPC frames) and max_data_connections.
The connection itself (hello with the token, TLS, limits, eviction, error replies) is
asyncps.net.framed's; this file only says what a pull, a push and a push-pull mean: the decisions
are ShardService's, exactly as for gRPC frames.

Gradients land with recv_into in arrays the connection keeps for the next request (the
service copies whatever it keeps: asyncps.rules.modes); values are sent from memoryviews over
the shard's read-only arrays.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence

import grpc
from asyncps.ps.adapter import AdapterStartError, ShardSide, checked_wait, reply_header
from asyncps.ps.service import ShardService

from asyncps.net.framed import FramedKind, FramedLimits, FramedListener
from asyncps.net.handlers import Handler
from asyncps.net.security import LOOPBACK_HOST, SecurityConfig
from asyncps.pb import ps_pb2
from asyncps.wire.codec import Array, Gradient, TensorAssembler
from asyncps.wire.frames import Slice, tensor_slices
from asyncps.wire.proto import outcome_to_proto, push_request
from asyncps.wire.shard import ShardValues
from asyncps.wire.stream import byte_view

log = logging.getLogger(__name__)

_WHOLE = 1 << 62  # tensor_slices chunk size: every tensor travels whole


class TcpKinds:
    """The "tcp" channel's request kinds over one ShardService: pull, push and push-pull."""

    def __init__(self, service: ShardService, max_request_bytes: int = FramedLimits.max_request_bytes) -> None:
        self._service = service
        self._max_request_bytes = max_request_bytes

    def kinds(self) -> list[FramedKind]:
        """The kinds to offer on the data connection, each with the method whose roles it needs."""
        return [FramedKind("pull", "Pull", self.pull), FramedKind("push", "Push", self.push, tensors=True),
                FramedKind("push_pull", "PushPull", self.push_pull, tensors=True)]

    def pull(self, request: ps_pb2.FramedRequest, tensors: Sequence[Array]) -> tuple[ps_pb2.FramedReply, list[Slice]]:
        """The values (none when not newer), held up to the request's wait."""
        pull = request.pull
        wait = checked_wait("wait_timeout_s", pull.wait_timeout_s)
        return self._values(self._service.pull(pull.worker_id, pull.if_newer_than, wait), None)

    def push(self, request: ps_pb2.FramedRequest, tensors: Sequence[Array]) -> tuple[ps_pb2.FramedReply, list[Slice]]:
        """Apply or drop one gradient."""
        push = push_request(request.push, self._grads(request, tensors))
        return ps_pb2.FramedReply(pushed=outcome_to_proto(self._service.push(push))), []

    def push_pull(self, request: ps_pb2.FramedRequest,
                  tensors: Sequence[Array]) -> tuple[ps_pb2.FramedReply, list[Slice]]:
        """Push, wait while sync/ssp holds the worker, then the values."""
        header = request.push_pull
        push = push_request(header, self._grads(request, tensors))
        wait = checked_wait("read_wait_s", header.read_wait_s)
        outcome, values = self._service.push_pull(push, header.pull_if_newer_than, wait)
        return self._values(values, outcome_to_proto(outcome))

    def _grads(self, request: ps_pb2.FramedRequest, tensors: Sequence[Array]) -> dict[str, Gradient]:
        """The request's gradients, as views of the arrays they landed in (counted as tcp's bytes)."""
        assembler = TensorAssembler(self._max_request_bytes)
        for chunk, array in zip(request.tensors, tensors, strict=True):
            assembler.add(chunk, byte_view(array))  # a view, no copy
        grads = assembler.finish()
        self._service.count("tcp", pushed=assembler.total_bytes)
        return grads

    def _values(self, reply: ShardValues,
                push: ps_pb2.PushResult | None) -> tuple[ps_pb2.FramedReply, list[Slice]]:
        header = reply_header(reply, push, self._service.shard_index)
        tensors: list[Slice] = []
        if reply.values is not None:
            for name, value in reply.values.items():
                tensors.extend(tensor_slices(name, value, chunk_bytes=_WHOLE))
            self._service.count("tcp", pulled=sum(v.nbytes for v in reply.values.values()))
        return ps_pb2.FramedReply(values=header), tensors


class TcpShardServer(FramedListener):
    """A data port serving only the "tcp" channel's kinds over `service` (tests and tools; a shard
    serves every channel's kinds through TcpAdapter)."""

    def __init__(self, service: ShardService, security: SecurityConfig | None = None, host: str = LOOPBACK_HOST,
                 port: int = 0, limits: FramedLimits | None = None) -> None:
        limits = limits or FramedLimits()
        kinds = TcpKinds(service, limits.max_request_bytes).kinds()
        super().__init__({k.kind: k for k in kinds}, security, host, port, limits)


class TcpAdapter:
    """The shard side of "tcp" (a ShardAdapter): its request kinds offered on the shard's data
    connection, DataPort over gRPC, and the data port's listener over every channel's kinds."""

    def __init__(self, side: ShardSide) -> None:
        self._side = side
        self._lock = threading.Lock()
        self._server: FramedListener | None = None
        self._max_request_bytes = min(side.max_request_bytes, FramedLimits.max_request_bytes)
        for kind in TcpKinds(side.service, self._max_request_bytes).kinds():
            side.offer(kind)

    @property
    def port(self) -> int:
        """Where the data port listens; 0 before start, after close or with none (data_port -1)."""
        with self._lock:
            return self._server.port if self._server is not None else 0

    @property
    def server(self) -> FramedListener | None:
        """The listener while it runs."""
        with self._lock:
            return self._server

    def DataPort(self, request: ps_pb2.DataPortRequest, context: grpc.ServicerContext) -> ps_pb2.DataPortResponse:
        """Where this shard's framed data connection listens (0: none; the worker uses gRPC frames)."""
        return ps_pb2.DataPortResponse(port=self.port)

    def rpc_handlers(self) -> dict[str, Handler]:
        """DataPort, protobuf both ways."""
        return {"DataPort": grpc.unary_unary_rpc_method_handler(
            self.DataPort, request_deserializer=ps_pb2.DataPortRequest.FromString,
            response_serializer=ps_pb2.DataPortResponse.SerializeToString)}

    def start(self) -> None:
        """Bind and serve the data port (nothing with data_port -1)."""
        side = self._side
        data_port = int(side.setting("data_port"))
        if data_port < 0:
            log.info("shard %d: no TCP data port (--data-port -1): workers use gRPC frames", side.service.shard_index)
            return
        limits = FramedLimits(int(side.setting("max_data_connections")), side.idle_timeout_s,
                              max_request_bytes=self._max_request_bytes)
        try:
            server = FramedListener(side.framed_kinds, side.security, side.host, data_port, limits).start()
        except OSError as exc:
            why = os.strerror(exc.errno) if exc.errno else str(exc)
            raise AdapterStartError(f"the tcp data port {side.host}:{data_port} cannot be bound ({why}): give "
                                    "--data-port a free port (0: any free port, -1: none, workers use gRPC "
                                    "frames)") from None
        with self._lock:
            self._server = server

    def close(self) -> None:
        """Stop the listener and end every data connection."""
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.stop()


__all__ = ["TcpAdapter", "TcpKinds", "TcpShardServer"]
