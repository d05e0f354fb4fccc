"""The shard adapter of the "tcp" transport: a data port with persistent worker connections,
announced over the shard's gRPC server (DataPort), on the shard's one ShardService.

TcpAdapter (the registry's factory, built from ShardSide by asyncps.ps.main) answers DataPort
and runs the listener (start, close); its shard setting data_port (`asyncps ps --data-port`, declared
in its registry entry) picks its port (0: any free port; -1:
none, DataPort answers 0 and workers fall back to gRPC frames). A worker opens one connection
per shard to that port and speaks first: a hello with its bearer token, checked in constant time against the same
token table as the gRPC path (asyncps.net.authz), intersected with its certificate's roles
under mutual TLS. Then request, reply, in turn, each one prefixed frame (asyncps.wire.stream):
pull, push or push-pull, answered with the values, the outcome, or a typed error (a grpc
status code number and a message). The decisions are ShardService's, exactly as for gRPC frames.

Gradients land with recv_into in arrays the connection keeps for the next request (the
service copies whatever it keeps: asyncps.rules.modes); values are sent from memoryviews over
the shard's read-only arrays. Bounded like the gRPC stream guard: at most max_connections,
each with its own thread; a connection waiting on its client longer than idle_timeout_s (or
handshake_timeout_s before its hello) is closed, and a newcomer that finds the shard full
evicts the connection that has waited on its client longest (refused only when none waits).
A frame that breaks the format or the limits gets one error reply and the connection closes;
nothing of it reaches the store.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from asyncps.ps.adapter import (
    DEFAULT_MAX_REQUEST_BYTES,
    MAX_WAIT_S,
    AdapterStartError,
    LeanRequest,
    ShardSide,
    checked_wait,
    reply_header,
)
from asyncps.ps.service import ShardService

from asyncps.errors import (
    InvalidArgumentError,
    PermissionDeniedError,
    UnauthenticatedError,
)
from asyncps.net.authz import ALL_ROLES, AUTH_METADATA_KEY, BEARER_SCHEME, METHOD_ROLES, WORKER, TokenRoles
from asyncps.net.handlers import Handler
from asyncps.net.rpc import outcome_name, status_of
from asyncps.net.security import LOOPBACK_HOST, SecurityConfig
from asyncps.net.streamguard import DEFAULT_IDLE_TIMEOUT_S
from asyncps.pb import ps_pb2, tensor_pb2
from asyncps.transport.registry import DEFAULT_MAX_DATA_CONNECTIONS
from asyncps.wire.codec import Array, TensorAssembler, _checked_nbytes, dtype_from_proto
from asyncps.wire.frames import Slice, tensor_slices
from asyncps.wire.proto import SHARD_SERVICE, outcome_to_proto, push_request
from asyncps.wire.shard import ShardValues
from asyncps.wire.stream import (
    BROKEN_FRAME,
    MAX_FRAME_BYTES,
    FrameError,
    StreamClosed,
    byte_view,
    read_head,
    read_payload,
    send_frame,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS = DEFAULT_MAX_DATA_CONNECTIONS
DEFAULT_HANDSHAKE_TIMEOUT_S = 5.0
_WHOLE = 1 << 62  # tensor_slices chunk size: every tensor travels whole
_METHODS = {"pull": "Pull", "push": "Push", "push_pull": "PushPull"}


@dataclass(frozen=True)
class TcpLimits:
    """How many connections the data port admits, how long one may wait on its client, how big a request."""

    max_connections: int = DEFAULT_MAX_CONNECTIONS
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError("the data port must admit at least one connection")
        if not (self.idle_timeout_s > 0 and self.handshake_timeout_s > 0):
            raise ValueError("data-port timeouts must be > 0 seconds")
        if not 0 < self.max_request_bytes <= MAX_FRAME_BYTES:
            raise ValueError(f"max_request_bytes must be in (0, {MAX_FRAME_BYTES}]")


class _Connection:
    """One accepted connection: its socket, and since when it has been waiting on its client."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.waiting_since: float | None = time.monotonic()  # None: the shard is working for it
        self.buffers: dict[tuple[str, int, int, tuple[int, ...]], Array] = {}

    def evict(self) -> None:
        """End the connection from another thread (its own thread sees EOF and exits)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


def certificate_roles(cert: Mapping[str, Any] | None, chief_names: frozenset[str]) -> frozenset[str]:
    """Chief and worker for a verified certificate naming a chief identity; worker for another."""
    names: set[str] = set()
    for rdn in (cert or {}).get("subject", ()):
        names.update(value for key, value in rdn if key == "commonName")
    names.update(value for _kind, value in (cert or {}).get("subjectAltName", ()))
    if not names:
        return frozenset()
    return ALL_ROLES if names & chief_names else frozenset({WORKER})


class TcpShardServer:
    """Serves one shard's pull, push and push-pull on a TCP data port, over ShardService."""

    def __init__(self, service: ShardService, security: SecurityConfig | None = None, host: str = LOOPBACK_HOST,
                 port: int = 0, limits: TcpLimits | None = None,
                 lean_requests: Mapping[str, LeanRequest] | None = None) -> None:
        self._service = service
        # header-only kinds other adapters answer here (shm's doorbell), looked up per request
        self._lean: Mapping[str, LeanRequest] = lean_requests if lean_requests is not None else {}
        self._security = security or SecurityConfig()
        self._limits = limits or TcpLimits()
        self._tokens = (TokenRoles(self._security.token, self._security.chief_token, self._security.shared_token)
                        if self._security.token else None)
        self._tls = self._security.ssl_server_context()
        self._listener = socket.create_server((host, port), backlog=128, reuse_port=False)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._connections: dict[int, _Connection] = {}
        self._stopping = threading.Event()
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"tcp-accept-{self.port}", daemon=True)

    def start(self) -> TcpShardServer:
        """Start accepting connections."""
        self._acceptor.start()
        log.info("TCP data port %d (%s, at most %d connections)", self.port,
                 "TLS" if self._tls else "plaintext", self._limits.max_connections)
        return self

    def stop(self) -> None:
        """Stop accepting and end every connection."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            connections = list(self._connections.values())
        for connection in connections:
            connection.evict()
        self._acceptor.join(timeout=5.0)

    @property
    def connections(self) -> int:
        """Connections open now."""
        with self._lock:
            return len(self._connections)

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, address = self._listener.accept()
            except OSError:
                if self._stopping.is_set():
                    return
                continue
            connection = _Connection(sock, f"{address[0]}:{address[1]}")
            if not self._admit(connection):
                log.warning("data port full (%d connections, none idle): refused %s", self._limits.max_connections,
                            connection.peer)
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(connection,), name=f"tcp-{connection.peer}",
                             daemon=True).start()

    def _admit(self, connection: _Connection) -> bool:
        """Take a slot, evicting the connection that has waited on its client longest when full."""
        victim = None
        with self._lock:
            if len(self._connections) >= self._limits.max_connections:
                idle = [c for c in self._connections.values() if c.waiting_since is not None]
                if not idle:
                    return False
                victim = min(idle, key=lambda c: c.waiting_since or 0.0)
                del self._connections[id(victim)]
            self._connections[id(connection)] = connection
        if victim is not None:
            log.warning("data port full: evicted %s (idle %.1fs) for %s", victim.peer,
                        time.monotonic() - (victim.waiting_since or 0.0), connection.peer)
            victim.evict()
        return True

    def _serve(self, connection: _Connection) -> None:
        sock = connection.sock
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            handshake_deadline = time.monotonic() + self._limits.handshake_timeout_s
            if self._tls is not None:
                sock.settimeout(self._limits.handshake_timeout_s)
                sock = connection.sock = self._tls.wrap_socket(sock, server_side=True)
            roles = self._hello(connection, sock, handshake_deadline)
            if roles is not None:
                self._requests(connection, sock, roles)
        except (OSError, StreamClosed, ssl.SSLError) as exc:
            log.debug("data connection %s ended: %s", connection.peer, exc)
        except Exception:
            log.exception("data connection %s failed", connection.peer)
        finally:
            with self._lock:
                self._connections.pop(id(connection), None)
            with contextlib.suppress(OSError):
                sock.close()

    def _hello(self, connection: _Connection, sock: socket.socket, deadline: float) -> frozenset[str] | None:
        """The caller's roles from its hello (token, certificate), or None after an error reply."""
        try:
            request, places = read_head(sock, ps_pb2.TcpRequest.FromString, "hello", 1 << 16, 1 << 16, deadline)
            if request.WhichOneof("kind") != "hello" or places:
                raise FrameError("the first request on a data connection is a hello without tensors")
            roles = self._roles(request.hello.token, sock)
        except (*BROKEN_FRAME, UnauthenticatedError, TimeoutError) as exc:
            self._reply_error(sock, exc if not isinstance(exc, TimeoutError)
                              else UnauthenticatedError("no hello in time"))
            log.warning("data connection %s refused: %s", connection.peer, exc)
            return None
        send_frame(sock, ps_pb2.TcpReply(hello=True))
        log.info("data connection from %s (%s)", connection.peer, request.hello.worker_id or "?")
        return roles

    def _roles(self, token: str, sock: socket.socket) -> frozenset[str]:
        roles = ALL_ROLES
        if self._tokens is not None:
            found = self._tokens.roles([(AUTH_METADATA_KEY, f"{BEARER_SCHEME} {token}")])
            if isinstance(found, str):
                raise UnauthenticatedError(found)
            roles = found
        if self._security.mtls and isinstance(sock, ssl.SSLSocket):
            roles = roles & certificate_roles(sock.getpeercert(), frozenset(self._security.chief_identities))
        return roles

    def _requests(self, connection: _Connection, sock: socket.socket, roles: frozenset[str]) -> None:
        limits = self._limits

        def working() -> None:
            connection.waiting_since = None

        while not self._stopping.is_set():
            if connection.waiting_since is None:  # (set before the last reply went out: see below)
                connection.waiting_since = time.monotonic()
            idle_deadline = connection.waiting_since + limits.idle_timeout_s
            try:
                # idle until a request's first byte, which may come just before the idle deadline (a
                # worker held by sync on another shard for as long): then the rest follows promptly
                request, places = read_head(sock, ps_pb2.TcpRequest.FromString, "request", limits.max_request_bytes,
                                            deadline=idle_deadline, first_byte=working,
                                            then_within_s=limits.idle_timeout_s)
                # the frame's bytes must follow promptly: a slow drip is as idle as silence
                payload_deadline = time.monotonic() + limits.idle_timeout_s
                kind = request.WhichOneof("kind") or "none"
                if kind not in _METHODS and kind not in self._lean:
                    raise FrameError(f"request kind {kind}: "
                                     + ", ".join(["pull", "push", "push_pull", *sorted(self._lean)]))
                assembler = TensorAssembler(limits.max_request_bytes)
                arrays = read_payload(sock, places, lambda chunk: self._destination(connection, chunk),
                                      payload_deadline)
            except (*BROKEN_FRAME, TimeoutError) as exc:
                if isinstance(exc, TimeoutError) and connection.waiting_since is not None:
                    log.info("data connection %s idle for %.0fs: closed", connection.peer, limits.idle_timeout_s)
                    return
                self._reply_error(sock, exc if not isinstance(exc, TimeoutError) else InvalidArgumentError(
                    f"the request's bytes did not arrive within {limits.idle_timeout_s:g}s"))
                log.warning("data connection %s: %s; closed", connection.peer, exc)
                return
            try:
                self._authorize(kind, roles)
                for place_chunk, array in zip(request.tensors, arrays, strict=True):
                    assembler.add(place_chunk, byte_view(array))  # a view, no copy
                reply, tensors = self._handle(kind, request, assembler)
            except Exception as exc:
                connection.waiting_since = time.monotonic()
                self._reply_error(sock, exc)
                continue
            sock.settimeout(limits.idle_timeout_s)  # a client that does not read its reply is idle too
            # waiting on its client from before the reply leaves: once the client holds the answer, the
            # connection must already count as idle (eviction picks the connection idle longest)
            connection.waiting_since = time.monotonic()
            send_frame(sock, reply, tensors)

    def _authorize(self, kind: str, roles: frozenset[str]) -> None:
        method = _METHODS[kind] if kind in _METHODS else self._lean[kind].method
        allowed = METHOD_ROLES.get(f"/{SHARD_SERVICE}/{method}", frozenset())
        if not roles & allowed:
            raise PermissionDeniedError(f"{method} needs the {'+'.join(sorted(allowed)) or 'no'} role; "
                                        f"this connection's hello grants {'+'.join(sorted(roles)) or 'no role'}")

    def _destination(self, connection: _Connection, chunk: tensor_pb2.TensorChunk) -> Array:
        """A per-connection array for a gradient tensor, reused by the next request of its shape."""
        if chunk.role not in (tensor_pb2.DENSE, tensor_pb2.SPARSE_INDICES, tensor_pb2.SPARSE_VALUES):
            raise FrameError(f"{chunk.name}: unknown tensor role {chunk.role}")
        try:
            dtype = dtype_from_proto(chunk.dtype)
            nbytes = _checked_nbytes(chunk.shape, dtype, self._limits.max_request_bytes)
        except InvalidArgumentError as exc:
            raise FrameError(f"{chunk.name}: {exc}") from None
        except Exception as exc:  # ResourceExhaustedError: larger than a request may be
            raise FrameError(f"{chunk.name}: {exc}") from None
        if nbytes != chunk.nbytes:
            raise FrameError(f"{chunk.name}: {chunk.nbytes} bytes for a {dtype}{list(chunk.shape)} tensor of {nbytes}")
        shape = tuple(int(d) for d in chunk.shape)
        key = (chunk.name, int(chunk.role), int(chunk.dtype), shape)
        array = connection.buffers.get(key)
        if array is None:
            if sum(a.nbytes for a in connection.buffers.values()) + nbytes > self._limits.max_request_bytes:
                connection.buffers.clear()  # another model or sparse rows of another size: start over
            array = connection.buffers[key] = np.empty(shape, dtype)
        return array

    def _handle(self, kind: str, request: ps_pb2.TcpRequest,
                assembler: TensorAssembler) -> tuple[ps_pb2.TcpReply, list[Slice]]:
        service = self._service
        lean = self._lean.get(kind) if kind not in _METHODS else None
        if lean is not None:
            if request.tensors:
                raise InvalidArgumentError(f"a {kind} request carries no tensors")
            return ps_pb2.TcpReply(values=lean.handle(request, MAX_WAIT_S)), []
        if kind == "pull":
            pull = request.pull
            if request.tensors:
                raise InvalidArgumentError("a pull carries no tensors")
            values = service.pull(pull.worker_id, pull.if_newer_than, checked_wait("wait_timeout_s",
                                                                                 pull.wait_timeout_s))
            return self._values(values, None)
        header = request.push if kind == "push" else request.push_pull
        grads = assembler.finish()
        service.count("tcp", pushed=assembler.total_bytes)
        push = push_request(header, grads)
        if kind == "push":
            return ps_pb2.TcpReply(pushed=outcome_to_proto(service.push(push))), []
        wait = checked_wait("read_wait_s", header.read_wait_s)
        outcome, values = service.push_pull(push, header.pull_if_newer_than, wait)
        return self._values(values, outcome_to_proto(outcome))

    def _values(self, reply: ShardValues,
                push: ps_pb2.PushResult | None) -> tuple[ps_pb2.TcpReply, list[Slice]]:
        header = reply_header(reply, push, self._service.shard_index)
        tensors: list[Slice] = []
        if reply.values is not None:
            for name, value in reply.values.items():
                tensors.extend(tensor_slices(name, value, chunk_bytes=_WHOLE))
            self._service.count("tcp", pulled=sum(v.nbytes for v in reply.values.values()))
        return ps_pb2.TcpReply(values=header), tensors

    @staticmethod
    def _reply_error(sock: socket.socket, exc: BaseException) -> None:
        code = status_of(exc) if isinstance(exc, Exception) else grpc.StatusCode.INTERNAL
        if code is grpc.StatusCode.INTERNAL:
            log.error("data request failed unexpectedly", exc_info=exc)
            message = f"internal error ({type(exc).__name__}); see the shard's log"
        else:
            message = str(exc)[:1000]
        try:
            sock.settimeout(1.0)  # a client that does not read its error does not hold this thread
            send_frame(sock, ps_pb2.TcpReply(error=ps_pb2.TcpError(code=code.value[0], message=message,
                                                                   outcome=outcome_name(exc))))
        except OSError:
            pass


class TcpAdapter:
    """The shard side of "tcp" (a ShardAdapter): DataPort over gRPC, and the data port's listener
    over the shard's one ShardService (its decisions, byte counters and waiter slots)."""

    def __init__(self, side: ShardSide) -> None:
        self._side = side
        self._lock = threading.Lock()
        self._server: TcpShardServer | None = None

    @property
    def port(self) -> int:
        """Where the data port listens; 0 before start, after close or with none (data_port -1)."""
        with self._lock:
            return self._server.port if self._server is not None else 0

    @property
    def server(self) -> TcpShardServer | None:
        """The listener while it runs."""
        with self._lock:
            return self._server

    def DataPort(self, request: ps_pb2.DataPortRequest, context: grpc.ServicerContext) -> ps_pb2.DataPortResponse:
        """Where this shard's TCP data path listens (0: none; the worker uses gRPC frames)."""
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
        limits = TcpLimits(int(side.setting("max_data_connections")), side.idle_timeout_s,
                           max_request_bytes=min(side.max_request_bytes, TcpLimits.max_request_bytes))
        try:
            server = TcpShardServer(side.service, side.security, side.host, data_port, limits,
                                    side.lean_requests).start()
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


__all__ = ["DEFAULT_MAX_CONNECTIONS", "TcpAdapter", "TcpLimits", "TcpShardServer", "certificate_roles"]
