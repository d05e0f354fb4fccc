"""The client of the "tcp" channel: pull, push and push-pull to one shard with their tensors in the
frames of its framed data connection (TcpDataPath, built by the registry's factory tcp_data_path).

gRPC stays the control plane: it tells the connection where the shard's data port is (DataPort)
and carries everything else. The connection (asyncps.net.framed: framing, hello with the token, TLS,
reconnects through the one retry policy, errors as asyncps.errors of the gRPC path's kinds) is
shared with no other channel's code; this channel adds its request kinds (ps.proto's FramedRequest:
pull, push, push_pull; answered by ps/tcp.py): the gradients are sent from memoryviews over the
worker's arrays, and the values are received with recv_into straight into the worker's buffers. A
row read's ids travel as ROW_IDS tensors of the request, its rows and clocks as the reply's tensors.
Training calls also ride a shard not yet restored, as over gRPC. When the shard has no data port,
or it cannot be reached, DataPortUnavailable says so and TcpDataPath hands this and every later
call to its fallback (gRPC frames).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TypeVar

from asyncps.errors import InvalidArgumentError
from asyncps.net.framed import DEFAULT_CONNECT_TIMEOUT_S, DataPortUnavailable, FramedConnection, reply_destination
from asyncps.net.security import SecurityConfig
from asyncps.pb import ps_pb2
from asyncps.transport.base import ClientSetup, DataPath
from asyncps.transport.grpc_shard import FramesDataPath, received_values
from asyncps.transport.link import ShardLink, data_connection
from asyncps.wire.codec import Array, IndexArray
from asyncps.wire.frames import Slice, gradient_slices, row_id_slices
from asyncps.wire.proto import outcome_from_proto, push_header
from asyncps.wire.shard import PushOutcome, PushRequest, ShardValues
from asyncps.wire.stream import FrameError

log = logging.getLogger(__name__)

T = TypeVar("T")
_WHOLE = 1 << 62  # gradient_slices chunk size: every tensor travels whole


class TcpConnection(FramedConnection):
    """The "tcp" channel over one framed connection to a shard: pull, push and push-pull with their
    tensors in the frames (thread-safe: one exchange at a time); DataPortUnavailable when there is
    no data port to connect to."""

    def pull(self, worker_id: str, if_newer_than: int = -1, buffers: Mapping[str, Array] | None = None,
             wait_timeout_s: float = 0.0, rows: Mapping[str, IndexArray] | None = None) -> ShardValues:
        """The shard's values (received into `buffers` where they fit), or None when not newer; the parts
        in `rows` as those rows only (their ids sent as ROW_IDS tensors)."""
        request = ps_pb2.FramedRequest(pull=ps_pb2.PullRequest(worker_id=worker_id, if_newer_than=if_newer_than,
                                                            wait_timeout_s=wait_timeout_s))
        reply, arrays = self.exchange(worker_id, request, list(row_id_slices(rows or {}, _WHOLE)),
                                      reply_destination(buffers), wait_timeout_s, training=True)
        return _values(reply, arrays, rows)

    def push(self, request: PushRequest) -> PushOutcome:
        """Apply or drop one gradient."""
        message = ps_pb2.FramedRequest(push=push_header(request))
        reply, _ = self.exchange(request.worker_id, message, _slices(request))
        if reply.WhichOneof("kind") != "pushed":
            raise InvalidArgumentError(f"shard {self.address} answered a push with {reply.WhichOneof('kind')}")
        return outcome_from_proto(reply.pushed)

    def push_pull(self, request: PushRequest, pull_if_newer_than: int = -1,
                  buffers: Mapping[str, Array] | None = None, read_wait_s: float = 0.0,
                  rows: Mapping[str, IndexArray] | None = None) -> tuple[PushOutcome, ShardValues]:
        """Push, then receive the values in one round trip (held up to read_wait_s by sync/ssp); the parts
        in `rows` as those rows only."""
        message = ps_pb2.FramedRequest(push_pull=push_header(request, pull_if_newer_than, read_wait_s))
        reply, arrays = self.exchange(request.worker_id, message, _slices(request, rows), reply_destination(buffers),
                                      read_wait_s, training=True)
        shard_values = _values(reply, arrays, rows)
        return outcome_from_proto(reply.values.push), shard_values


def _slices(request: PushRequest, rows: Mapping[str, IndexArray] | None = None) -> list[Slice]:
    slices: list[Slice] = []
    for name, grad in request.grads.items():
        slices.extend(gradient_slices(name, grad, _WHOLE))
    slices.extend(row_id_slices(rows or {}, _WHOLE))
    return slices


def _values(reply: ps_pb2.FramedReply, arrays: list[Array], rows: Mapping[str, IndexArray] | None) -> ShardValues:
    """A reply's header, dense values and rows served (checked against the rows asked)."""
    if reply.WhichOneof("kind") != "values":
        raise FrameError(f"a reply of kind {reply.WhichOneof('kind')} where values belong")
    return received_values(reply.values, reply.tensors, arrays, rows)


class TcpDataPath:
    """The "tcp" data path to one shard: per-step tensors over a TcpConnection to the data port the
    shard announces over the link (DataPort); `fallback` (gRPC frames) from the first time the
    shard has no data port or it cannot be reached (DataPortUnavailable)."""

    def __init__(self, link: ShardLink, fallback: DataPath, security: SecurityConfig | None = None,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S) -> None:
        self.address = link.address
        self._fallback = fallback
        self._connection: TcpConnection | None = data_connection(link, security, connect_timeout_s, TcpConnection)

    @property
    def uses_tcp(self) -> bool:
        """Whether per-step tensors still travel over TCP (False after a fall back)."""
        return self._connection is not None

    def _data(self, over_tcp: Callable[[TcpConnection], T], over_fallback: Callable[[DataPath], T]) -> T:
        connection = self._connection
        if connection is not None:
            try:
                return over_tcp(connection)
            except DataPortUnavailable as exc:
                log.warning("%s: using the fallback path", exc)
                connection.close()
                self._connection = None
        return over_fallback(self._fallback)

    def pull(self, worker_id: str, if_newer_than: int = -1, buffers: Mapping[str, Array] | None = None,
             wait_timeout_s: float = 0.0, rows: Mapping[str, IndexArray] | None = None) -> ShardValues:
        """See DataPath.pull."""
        return self._data(lambda c: c.pull(worker_id, if_newer_than, buffers, wait_timeout_s, rows),
                          lambda f: f.pull(worker_id, if_newer_than, buffers, wait_timeout_s, rows))

    def push(self, request: PushRequest) -> PushOutcome:
        """See DataPath.push."""
        return self._data(lambda c: c.push(request), lambda f: f.push(request))

    def push_pull(self, request: PushRequest, pull_if_newer_than: int = -1,
                  buffers: Mapping[str, Array] | None = None, read_wait_s: float = 0.0,
                  rows: Mapping[str, IndexArray] | None = None) -> tuple[PushOutcome, ShardValues]:
        """See DataPath.push_pull."""
        return self._data(lambda c: c.push_pull(request, pull_if_newer_than, buffers, read_wait_s, rows),
                          lambda f: f.push_pull(request, pull_if_newer_than, buffers, read_wait_s, rows))

    def close(self) -> None:
        """Close the data connection and the fallback (the channel is the link's, closed by the control)."""
        connection = self._connection
        if connection is not None:
            connection.close()
        self._fallback.close()


def tcp_data_path(setup: ClientSetup, fallback: DataPath | None, required: bool) -> DataPath:
    """The registry's factory for "tcp": a TCP data connection per shard, with the next path of
    "auto" (gRPC frames) as the fallback, named or not: a shard without a reachable data port
    (an older shard, --data-port -1, a port a firewall drops) is served over frames, and says so."""
    return TcpDataPath(setup.link, fallback or FramesDataPath(setup.link, setup.chunk_bytes), setup.security)


__all__ = ["DataPortUnavailable", "TcpConnection", "TcpDataPath", "tcp_data_path"]
