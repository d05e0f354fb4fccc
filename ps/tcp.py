"""The shard adapter of the "tcp" channel: pull, push and push-pull with their tensors in the frames
of the shard's framed data connection (asyncps.net.framed), on the shard's one ShardService.

TcpAdapter (the registry's factory, built from ShardSide by asyncps.ps.main) only offers its three
request kinds on ShardSide beside every other channel's (shm's doorbell); the shard's data port
(asyncps.ps.dataport: DataPort, the listener, --data-port, --max-data-connections) serves them.
The connection itself (hello with the token, TLS, limits, eviction, error replies) is
asyncps.net.framed's; this file only says what a pull, a push and a push-pull mean: the decisions
are ShardService's, exactly as for gRPC frames.

Gradients land with recv_into in arrays the connection keeps for the next request (the
service copies whatever it keeps: asyncps.rules.modes); values are sent from memoryviews over
the shard's read-only arrays.
"""

from __future__ import annotations

from collections.abc import Sequence

from asyncps.ps.adapter import ShardSide, checked_wait, reply_header
from asyncps.ps.service import ShardService

from asyncps.errors import InvalidArgumentError
from asyncps.net.framed import FramedKind, FramedLimits, FramedListener
from asyncps.net.handlers import Handler
from asyncps.net.security import LOOPBACK_HOST, SecurityConfig
from asyncps.pb import ps_pb2
from asyncps.wire.codec import Array, TensorAssembler, rows_nbytes
from asyncps.wire.frames import Slice, served_row_slices, tensor_slices
from asyncps.wire.proto import outcome_to_proto, push_request, rows_of_request
from asyncps.wire.shard import ShardValues
from asyncps.wire.stream import byte_view

_WHOLE = 1 << 62  # tensor_slices chunk size: every tensor travels whole


class TcpKinds:
    """The "tcp" channel's request kinds over one ShardService: pull, push and push-pull."""

    def __init__(self, service: ShardService, max_request_bytes: int = FramedLimits.max_request_bytes) -> None:
        self._service = service
        self._max_request_bytes = max_request_bytes

    def kinds(self) -> list[FramedKind]:
        """The kinds to offer on the data connection, each with the method whose roles it needs."""
        return [FramedKind("pull", "Pull", self.pull, tensors=True),
                FramedKind("push", "Push", self.push, tensors=True),
                FramedKind("push_pull", "PushPull", self.push_pull, tensors=True)]

    def pull(self, request: ps_pb2.FramedRequest, tensors: Sequence[Array]) -> tuple[ps_pb2.FramedReply, list[Slice]]:
        """The values (none when not newer), held up to the request's wait; the parts its ROW_IDS
        tensors name as those rows."""
        pull = request.pull
        rows = rows_of_request(self._received(request, tensors), "pull")
        wait = checked_wait("wait_timeout_s", pull.wait_timeout_s)
        return self._values(self._service.pull(pull.worker_id, pull.if_newer_than, wait, rows), None)

    def push(self, request: ps_pb2.FramedRequest, tensors: Sequence[Array]) -> tuple[ps_pb2.FramedReply, list[Slice]]:
        """Apply or drop one gradient."""
        grads, rows = self._received(request, tensors).finish_request()
        if rows:
            raise InvalidArgumentError(f"{sorted(rows)}: a push reads no rows (a push-pull does)")
        push = push_request(request.push, grads)
        return ps_pb2.FramedReply(pushed=outcome_to_proto(self._service.push(push))), []

    def push_pull(self, request: ps_pb2.FramedRequest,
                  tensors: Sequence[Array]) -> tuple[ps_pb2.FramedReply, list[Slice]]:
        """Push, wait while sync/ssp holds the worker, then the values (the parts its ROW_IDS tensors
        name as those rows)."""
        header = request.push_pull
        grads, rows = self._received(request, tensors).finish_request()
        push = push_request(header, grads)
        wait = checked_wait("read_wait_s", header.read_wait_s)
        outcome, values = self._service.push_pull(push, header.pull_if_newer_than, wait, rows)
        return self._values(values, outcome_to_proto(outcome))

    def _received(self, request: ps_pb2.FramedRequest, tensors: Sequence[Array]) -> TensorAssembler:
        """The request's tensors, as views of the arrays they landed in (counted as tcp's bytes)."""
        assembler = TensorAssembler(self._max_request_bytes)
        for chunk, array in zip(request.tensors, tensors, strict=True):
            assembler.add(chunk, byte_view(array))  # a view, no copy
        self._service.count("tcp", pushed=assembler.total_bytes)
        return assembler

    def _values(self, reply: ShardValues,
                push: ps_pb2.PushResult | None) -> tuple[ps_pb2.FramedReply, list[Slice]]:
        header = reply_header(reply, push, self._service.shard_index)
        tensors: list[Slice] = []
        nbytes = 0
        if reply.values is not None:
            for name, value in reply.values.items():
                tensors.extend(tensor_slices(name, value, chunk_bytes=_WHOLE))
            nbytes = sum(v.nbytes for v in reply.values.values())
        if reply.rows:
            tensors.extend(served_row_slices(reply.rows, _WHOLE))
            nbytes += rows_nbytes(reply.rows)
        self._service.count("tcp", pulled=nbytes)
        return ps_pb2.FramedReply(values=header), tensors


class TcpShardServer(FramedListener):
    """A data port serving only the "tcp" channel's kinds over `service` (tests and tools; a shard
    serves every channel's kinds through asyncps.ps.dataport)."""

    def __init__(self, service: ShardService, security: SecurityConfig | None = None, host: str = LOOPBACK_HOST,
                 port: int = 0, limits: FramedLimits | None = None) -> None:
        limits = limits or FramedLimits()
        kinds = TcpKinds(service, limits.max_request_bytes).kinds()
        super().__init__({k.kind: k for k in kinds}, security, host, port, limits)


class TcpAdapter:
    """The shard side of "tcp" (a ShardAdapter): its request kinds offered on the shard's data
    connection, which the shard's data port (asyncps.ps.dataport) serves; no gRPC method of its own."""

    def __init__(self, side: ShardSide) -> None:
        for kind in TcpKinds(side.service, side.framed_request_bytes).kinds():
            side.offer(kind)

    def rpc_handlers(self) -> dict[str, Handler]:
        """None: its requests travel on the data connection (DataPort is the data port's)."""
        return {}

    def start(self) -> None:
        """Nothing: the shard's data port serves the kinds offered."""

    def close(self) -> None:
        """Nothing to release."""


__all__ = ["TcpAdapter", "TcpKinds", "TcpShardServer"]
