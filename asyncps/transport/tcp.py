"""The client of the "tcp" transport: pull, push and push-pull to one shard over one persistent
TCP connection (TcpDataPath, built by the registry's factory tcp_data_path).

gRPC stays the control plane: it tells this client where the shard's data port is (DataPort)
and carries everything else. Per step, a request and its reply are each one prefixed frame
(asyncps.wire.stream; the protocol is described in ps/tcp.py and ps.proto's TcpRequest): the
gradients are sent from memoryviews over the worker's arrays, and the values are received with
recv_into straight into the worker's buffers. The connection speaks first with the worker's
token, runs over TLS when the cluster does, and is re-opened with backoff when it breaks (a
shard restart: the new shard's port is asked again). Errors are asyncps.errors exceptions of the
same kinds as the gRPC path's (through the one table, asyncps.net.rpc.error_of); a broken connection
is an UnavailableError, and UNAVAILABLE (and, for training calls, a shard not yet restored) is retried
by the same policy as over gRPC (asyncps.net.retry) until deadline_s, then Unreachable. When the shard has
no data port, or it cannot be reached, DataPortUnavailable says so and TcpDataPath hands this and
every later call to its fallback (gRPC frames).
"""

from __future__ import annotations

import contextlib
import logging
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TypeVar

import numpy as np

from asyncps.errors import InvalidArgumentError, UnavailableError, UnimplementedError
from asyncps.net.retry import RetryPolicy
from asyncps.net.rpc import error_of
from asyncps.net.security import SecurityConfig
from asyncps.pb import ps_pb2, tensor_pb2
from asyncps.transport.base import ClientSetup, DataPath
from asyncps.transport.grpc_shard import FramesDataPath
from asyncps.transport.link import RIDE_RESTARTS, ShardLink
from asyncps.wire.codec import Array, _checked_nbytes, dtype_from_proto
from asyncps.wire.frames import Slice, gradient_slices
from asyncps.wire.proto import decisions_from_proto, outcome_from_proto, push_header
from asyncps.wire.shard import PushOutcome, PushRequest, ShardValues
from asyncps.wire.stream import (
    BROKEN_FRAME,
    MAX_FRAME_BYTES,
    FrameError,
    StreamClosed,
    read_head,
    read_payload,
    send_frame,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
_WHOLE = 1 << 62  # gradient_slices chunk size: every tensor travels whole
DEFAULT_CONNECT_TIMEOUT_S = 3.0


class DataPortUnavailable(ConnectionError):
    """The shard announces no TCP data port, or its port cannot be reached: use gRPC frames."""


def _split_host(address: str) -> str:
    host = address.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


class TcpConnection:
    """Pull, push and push-pull to one shard over a persistent TCP connection (thread-safe: one
    exchange at a time); DataPortUnavailable when there is no data port to connect to."""

    def __init__(self, address: str, data_port: Callable[[], int], security: SecurityConfig | None = None,
                 deadline_s: float = 60.0, call_timeout_s: float = 30.0,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S, seed: int | None = None,
                 abort: threading.Event | None = None) -> None:
        self.address = address
        self._host = _split_host(address)
        self._data_port = data_port
        self._security = security or SecurityConfig()
        self._call_timeout_s = call_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._rng = random.Random(seed)
        # the gRPC link's policies; the owner's stop event: a broken exchange is not retried once it is set
        self._policy = RetryPolicy(deadline_s, stop=abort)
        self._training_policy = replace(self._policy, retry_on=RIDE_RESTARTS)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._tls = self._client_context(self._security)

    @staticmethod
    def _client_context(security: SecurityConfig) -> ssl.SSLContext | None:
        if not security.tls:
            return None
        context = ssl.create_default_context(cafile=security.tls_ca or None)
        if security.tls_cert:
            context.load_cert_chain(security.tls_cert, security.tls_key)
        return context

    def _connect(self, worker_id: str) -> socket.socket:
        """Ask the shard's data port over gRPC, connect, say hello (DataPortUnavailable: no TCP path)."""
        try:
            port = self._data_port()
        except UnimplementedError:
            raise DataPortUnavailable(f"shard {self.address} has no DataPort call (an older shard)") from None
        if port <= 0:
            raise DataPortUnavailable(f"shard {self.address} serves no TCP data port")
        try:
            sock = socket.create_connection((self._host, port), timeout=self._connect_timeout_s)
        except OSError as exc:
            raise DataPortUnavailable(f"data port {self._host}:{port} of shard {self.address} cannot be "
                                      f"reached ({type(exc).__name__}: {exc})") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self._security.server_name_override or self._host)
            sock.settimeout(self._call_timeout_s)
            send_frame(sock, ps_pb2.TcpRequest(hello=ps_pb2.TcpHello(token=self._security.client_token,
                                                                     worker_id=worker_id)))
            reply, places = read_head(sock, ps_pb2.TcpReply.FromString, "hello reply", 1 << 16,
                                      deadline=time.monotonic() + self._call_timeout_s)
            if reply.WhichOneof("kind") == "error":
                raise error_of(reply.error.code, f"shard {self.address} data port: {reply.error.message}")
            if reply.WhichOneof("kind") != "hello" or places:
                raise FrameError("the shard's answer to hello is not a hello")
        except BaseException:
            sock.close()
            raise
        log.info("shard %s: tensors over TCP (data port %d%s)", self.address, port, ", TLS" if self._tls else "")
        return sock

    def _drop(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    def _exchange(self, worker_id: str, request: ps_pb2.TcpRequest, tensors: Sequence[Slice],
                  buffers: Mapping[str, Array] | None, wait_s: float, training: bool
                  ) -> tuple[ps_pb2.TcpReply, dict[str, Array]]:
        """One request and its reply, re-sent on a fresh connection after a broken one and, for
        the errors the gRPC path retries, by the same policy; Unreachable past deadline_s."""
        policy = self._training_policy if training else self._policy
        return policy.call(lambda: self._attempt(worker_id, request, tensors, buffers, wait_s),
                           f"parameter server {self.address} over TCP", self._rng)

    def _attempt(self, worker_id: str, request: ps_pb2.TcpRequest, tensors: Sequence[Slice],
                 buffers: Mapping[str, Array] | None, wait_s: float) -> tuple[ps_pb2.TcpReply, dict[str, Array]]:
        """One exchange; a broken connection or a shard restart (the stream out of step) as UnavailableError."""
        try:
            with self._lock:
                return self._once(worker_id, request, tensors, buffers, wait_s)
        except DataPortUnavailable:
            raise
        except (OSError, StreamClosed, *BROKEN_FRAME) as exc:
            raise UnavailableError(f"connection to shard {self.address} broken ({type(exc).__name__}: {exc})",
                                   "UNAVAILABLE") from exc

    def _once(self, worker_id: str, request: ps_pb2.TcpRequest, tensors: Sequence[Slice],
              buffers: Mapping[str, Array] | None, wait_s: float) -> tuple[ps_pb2.TcpReply, dict[str, Array]]:
        if self._sock is None:
            self._sock = self._connect(worker_id)
        sock = self._sock
        try:
            sock.settimeout(self._call_timeout_s)
            message = ps_pb2.TcpRequest()
            message.CopyFrom(request)
            send_frame(sock, message, tensors)
            deadline = time.monotonic() + self._call_timeout_s + wait_s
            reply, places = read_head(sock, ps_pb2.TcpReply.FromString, "reply", MAX_FRAME_BYTES, deadline=deadline)
            if reply.WhichOneof("kind") == "error":
                raise error_of(reply.error.code, reply.error.message, reply.error.outcome)
            arrays = read_payload(sock, places, lambda chunk: _destination(chunk, buffers), deadline)
        except BaseException:
            self._drop()  # out of step, or an error the shard may have closed on: a fresh one next time
            raise
        return reply, {chunk.name: array for chunk, array in zip(reply.tensors, arrays, strict=True)}

    def pull(self, worker_id: str, if_newer_than: int = -1, buffers: Mapping[str, Array] | None = None,
             wait_timeout_s: float = 0.0) -> ShardValues:
        """The shard's values (received into `buffers` where they fit), or None when not newer."""
        request = ps_pb2.TcpRequest(pull=ps_pb2.PullRequest(worker_id=worker_id, if_newer_than=if_newer_than,
                                                            wait_timeout_s=wait_timeout_s))
        reply, values = self._exchange(worker_id, request, (), buffers, wait_timeout_s, training=True)
        return _values(reply, values)

    def push(self, request: PushRequest) -> PushOutcome:
        """Apply or drop one gradient."""
        message = ps_pb2.TcpRequest(push=push_header(request))
        reply, _ = self._exchange(request.worker_id, message, _slices(request), None, 0.0, training=False)
        if reply.WhichOneof("kind") != "pushed":
            raise InvalidArgumentError(f"shard {self.address} answered a push with {reply.WhichOneof('kind')}")
        return outcome_from_proto(reply.pushed)

    def push_pull(self, request: PushRequest, pull_if_newer_than: int = -1,
                  buffers: Mapping[str, Array] | None = None, read_wait_s: float = 0.0
                  ) -> tuple[PushOutcome, ShardValues]:
        """Push, then receive the values in one round trip (held up to read_wait_s by sync/ssp)."""
        message = ps_pb2.TcpRequest(push_pull=push_header(request, pull_if_newer_than, read_wait_s))
        reply, values = self._exchange(request.worker_id, message, _slices(request), buffers, read_wait_s,
                                       training=True)
        shard_values = _values(reply, values)
        return outcome_from_proto(reply.values.push), shard_values

    def ring(self, worker_id: str, request: ps_pb2.TcpRequest, wait_s: float) -> ps_pb2.PullHeader:
        """A header-only request another path answers on this connection (shm's doorbell); its reply's
        header. Retried as the gRPC call it replaces: a broken connection or UNAVAILABLE, nothing else."""
        reply, _ = self._exchange(worker_id, request, (), None, wait_s, training=False)
        if reply.WhichOneof("kind") != "values" or reply.tensors:
            raise FrameError(f"shard {self.address} answered {request.WhichOneof('kind')} with "
                             f"{reply.WhichOneof('kind')}")
        return reply.values

    def close(self) -> None:
        """Close the connection."""
        with self._lock:
            self._drop()


def data_connection(link: ShardLink, security: SecurityConfig | None = None,
                    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S) -> TcpConnection:
    """A TcpConnection to the data port the shard announces over `link` (DataPort), with the link's
    deadlines; it connects on first use."""
    ask = link.channel.unary_unary(link.path("DataPort"),
                                   request_serializer=ps_pb2.DataPortRequest.SerializeToString,
                                   response_deserializer=ps_pb2.DataPortResponse.FromString)

    def data_port() -> int:
        reply = link.retry(lambda: ask(ps_pb2.DataPortRequest(), timeout=link.call_timeout_s))
        return int(reply.port)

    return TcpConnection(link.address, data_port, security, link.deadline_s, link.call_timeout_s, connect_timeout_s,
                         abort=link.abort)


def _slices(request: PushRequest) -> list[Slice]:
    slices: list[Slice] = []
    for name, grad in request.grads.items():
        slices.extend(gradient_slices(name, grad, _WHOLE))
    return slices


def _destination(chunk: tensor_pb2.TensorChunk, buffers: Mapping[str, Array] | None) -> Array:
    """The worker's own buffer for a value when it fits, else a fresh array (lengths checked first)."""
    if chunk.role != tensor_pb2.DENSE:
        raise FrameError(f"{chunk.name}: shard sent sparse values")
    dtype = dtype_from_proto(chunk.dtype)
    shape = tuple(int(d) for d in chunk.shape)
    nbytes = _checked_nbytes(shape, dtype, MAX_FRAME_BYTES)
    if nbytes != chunk.nbytes:
        raise FrameError(f"{chunk.name}: {chunk.nbytes} bytes for a {dtype}{list(shape)} value of {nbytes}")
    buffer = (buffers or {}).get(chunk.name)
    if (buffer is not None and buffer.shape == shape and buffer.dtype == dtype and buffer.flags.c_contiguous
            and buffer.flags.writeable):
        return buffer
    return np.empty(shape, dtype)


def _values(reply: ps_pb2.TcpReply, values: dict[str, Array]) -> ShardValues:
    if reply.WhichOneof("kind") != "values":
        raise FrameError(f"a reply of kind {reply.WhichOneof('kind')} where values belong")
    header = reply.values
    decisions = decisions_from_proto(header.sync) if header.HasField("sync") else None
    return ShardValues(header.version, header.incarnation, None if header.not_modified else values,
                       header.waited_s, decisions)


class TcpDataPath:
    """The "tcp" data path to one shard: per-step tensors over a TcpConnection to the data port the
    shard announces over the link (DataPort); `fallback` (gRPC frames) from the first time the
    shard has no data port or it cannot be reached (DataPortUnavailable)."""

    def __init__(self, link: ShardLink, fallback: DataPath, security: SecurityConfig | None = None,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S) -> None:
        self.address = link.address
        self._fallback = fallback
        self._connection: TcpConnection | None = data_connection(link, security, connect_timeout_s)

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
             wait_timeout_s: float = 0.0) -> ShardValues:
        """See DataPath.pull."""
        return self._data(lambda c: c.pull(worker_id, if_newer_than, buffers, wait_timeout_s),
                          lambda f: f.pull(worker_id, if_newer_than, buffers, wait_timeout_s))

    def push(self, request: PushRequest) -> PushOutcome:
        """See DataPath.push."""
        return self._data(lambda c: c.push(request), lambda f: f.push(request))

    def push_pull(self, request: PushRequest, pull_if_newer_than: int = -1,
                  buffers: Mapping[str, Array] | None = None, read_wait_s: float = 0.0
                  ) -> tuple[PushOutcome, ShardValues]:
        """See DataPath.push_pull."""
        return self._data(lambda c: c.push_pull(request, pull_if_newer_than, buffers, read_wait_s),
                          lambda f: f.push_pull(request, pull_if_newer_than, buffers, read_wait_s))

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


__all__ = ["DataPortUnavailable", "TcpConnection", "TcpDataPath", "data_connection", "tcp_data_path"]
