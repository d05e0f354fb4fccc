"""The framed data connection under every lean channel (ps-lite's Van; TensorPipe's channels): one
persistent socket per worker per shard, beside gRPC, that the channels' requests share.

It owns what is not a channel's: the framing (each message is `u32 little-endian N | N bytes: one
raw frame`, asyncps.wire.stream, in asyncps.wire.frames' layout), the handshake (the client speaks
first: a FramedHello with its bearer token), TLS when the cluster uses it, the limits (connections,
idle time, request size) and, on the client, reconnects through the one retry policy
(asyncps.net.retry). A channel only names its request kinds (FramedRequest's oneof) and what they
carry: the "tcp" channel's pull, push and push-pull with their tensors, the "shm" channel's
`mapped` doorbell with none. Neither channel imports the other; both import this.

Client: FramedConnection.exchange sends one request and reads its reply, errors as asyncps.errors of
the gRPC path's kinds (through asyncps.net.rpc's one table): a broken connection is an
UnavailableError and is re-opened (the port asked again: a restarted shard) by the retry policy;
DataPortUnavailable when the shard has no data port or it cannot be reached (the channel then falls
back, nothing having been sent).

Server: FramedListener accepts at most max_connections, each with its own thread; checks the hello's
token in constant time against the gRPC path's token table (asyncps.net.authz), intersected with the
certificate's roles under mutual TLS; closes a connection that waits on its client longer than
idle_timeout_s (handshake_timeout_s before its hello); lets a newcomer that finds it full evict the
connection idle longest (refused only when none waits); answers every request kind a channel
offered (FramedKind), authorized by the gRPC method it stands for. A frame that breaks the format or
the limits gets one error reply and the connection closes; nothing of it reaches a handler.
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
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from asyncps.errors import (
    InvalidArgumentError,
    PermissionDeniedError,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
)
from asyncps.net.authz import ALL_ROLES, AUTH_METADATA_KEY, BEARER_SCHEME, METHOD_ROLES, WORKER, TokenRoles
from asyncps.net.retry import RetryPolicy
from asyncps.net.rpc import error_of, outcome_name, status_of
from asyncps.net.security import LOOPBACK_HOST, SecurityConfig
from asyncps.net.streamguard import DEFAULT_IDLE_TIMEOUT_S
from asyncps.pb import ps_pb2, tensor_pb2
from asyncps.wire.codec import ROLES, Array, _checked_nbytes, dtype_from_proto
from asyncps.wire.frames import Slice
from asyncps.wire.proto import SHARD_SERVICE
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

DEFAULT_CONNECT_TIMEOUT_S = 3.0
DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_HANDSHAKE_TIMEOUT_S = 5.0
DEFAULT_MAX_REQUEST_BYTES = 2 << 30
_HELLO_BYTES = 1 << 16  # a hello is a token and a worker id

# the destination of each tensor of a reply (a worker's own buffer where it fits); None: header only
Destination = Callable[[tensor_pb2.TensorChunk], Array]


def reply_destination(buffers: Mapping[str, Array] | None = None) -> Destination:
    """Where a reply's tensors land: a dense value in the caller's buffer of its name when it fits
    (C-contiguous, writable, same dtype and shape), anything else (a row read's rows and clocks
    included) in a fresh array; every length checked before anything is received."""
    def destination(chunk: tensor_pb2.TensorChunk) -> Array:
        if chunk.role not in (tensor_pb2.DENSE, tensor_pb2.SPARSE_VALUES, tensor_pb2.ROW_CLOCKS):
            raise FrameError(f"{chunk.name}: a reply's tensor of role {chunk.role}")
        dtype = dtype_from_proto(chunk.dtype)
        shape = tuple(int(d) for d in chunk.shape)
        nbytes = _checked_nbytes(shape, dtype, MAX_FRAME_BYTES)
        if nbytes != chunk.nbytes:
            raise FrameError(f"{chunk.name}: {chunk.nbytes} bytes for a {dtype}{list(shape)} tensor of {nbytes}")
        buffer = (buffers or {}).get(chunk.name) if chunk.role == tensor_pb2.DENSE else None
        if (buffer is not None and buffer.shape == shape and buffer.dtype == dtype and buffer.flags.c_contiguous
                and buffer.flags.writeable):
            return buffer
        return np.empty(shape, dtype)

    return destination


class DataPortUnavailable(ConnectionError):
    """The shard announces no data port, or its port cannot be reached: the channel falls back."""


def _split_host(address: str) -> str:
    host = address.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def client_context(security: SecurityConfig) -> ssl.SSLContext | None:
    """The TLS context a data connection's client wraps its socket in (None: plaintext)."""
    if not security.tls:
        return None
    context = ssl.create_default_context(cafile=security.tls_ca or None)
    if security.tls_cert:
        context.load_cert_chain(security.tls_cert, security.tls_key)
    return context


class FramedConnection:
    """One worker's persistent framed connection to one shard's data port (thread-safe: one exchange
    at a time), opened on first use and re-opened after a break."""

    def __init__(self, address: str, data_port: Callable[[], int], security: SecurityConfig | None = None,
                 deadline_s: float = 60.0, call_timeout_s: float = 30.0,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S, seed: int | None = None,
                 abort: threading.Event | None = None, training_policy: RetryPolicy | None = None) -> None:
        self.address = address
        self._host = _split_host(address)
        self._data_port = data_port
        self._security = security or SecurityConfig()
        self._call_timeout_s = call_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._rng = random.Random(seed)
        # the gRPC link's policies; the owner's stop event: a broken exchange is not retried once it is set
        self._policy = RetryPolicy(deadline_s, stop=abort)
        self._training_policy = training_policy or self._policy
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._tls = client_context(self._security)

    def _connect(self, worker_id: str) -> socket.socket:
        """Ask the shard's data port over gRPC, connect, say hello (DataPortUnavailable: no data port)."""
        try:
            port = self._data_port()
        except UnimplementedError:
            raise DataPortUnavailable(f"shard {self.address} has no DataPort call (an older shard)") from None
        if port <= 0:
            raise DataPortUnavailable(f"shard {self.address} serves no data port")
        try:
            sock = socket.create_connection((self._host, port), timeout=self._connect_timeout_s)
        except OSError as exc:
            raise DataPortUnavailable(f"data port {self._host}:{port} of shard {self.address} cannot be "
                                      f"reached ({type(exc).__name__}: {exc})") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self._security.server_name_override or self._host)
            self._hello(sock, worker_id)
        except BaseException:
            sock.close()
            raise
        log.info("shard %s: framed data connection (port %d%s)", self.address, port, ", TLS" if self._tls else "")
        return sock

    def _hello(self, sock: socket.socket, worker_id: str) -> None:
        """Say hello with the token; the shard's answer (its typed error when it refuses)."""
        sock.settimeout(self._call_timeout_s)
        send_frame(sock, ps_pb2.FramedRequest(hello=ps_pb2.FramedHello(token=self._security.client_token,
                                                                       worker_id=worker_id)))
        reply, places = read_head(sock, ps_pb2.FramedReply.FromString, "hello reply", _HELLO_BYTES,
                                  deadline=time.monotonic() + self._call_timeout_s)
        if reply.WhichOneof("kind") == "error":
            raise error_of(reply.error.code, f"shard {self.address} data port: {reply.error.message}")
        if reply.WhichOneof("kind") != "hello" or places:
            raise FrameError("the shard's answer to hello is not a hello")

    def _drop(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    def exchange(self, worker_id: str, request: ps_pb2.FramedRequest, tensors: Sequence[Slice] = (),
                 destination: Destination | None = None, wait_s: float = 0.0, training: bool = False
                 ) -> tuple[ps_pb2.FramedReply, list[Array]]:
        """One request and its reply (the reply's tensors in the order of `reply.tensors`, each received
        into destination(chunk): a part may come as two tensors of different roles, the rows and clocks
        of a row read; a reply with tensors where `destination` is None is a broken frame). Re-sent
        on a fresh connection after a broken one and, for the errors the gRPC path retries, by the
        same policy (training calls: the training policy); Unreachable past the deadline."""
        policy = self._training_policy if training else self._policy
        return policy.call(lambda: self._attempt(worker_id, request, tensors, destination, wait_s),
                           f"parameter server {self.address} over its data connection", self._rng)

    def _attempt(self, worker_id: str, request: ps_pb2.FramedRequest, tensors: Sequence[Slice],
                 destination: Destination | None, wait_s: float) -> tuple[ps_pb2.FramedReply, list[Array]]:
        """One exchange; a broken connection or a shard restart (the stream out of step) as UnavailableError."""
        try:
            with self._lock:
                return self._once(worker_id, request, tensors, destination, wait_s)
        except DataPortUnavailable:
            raise
        except (OSError, StreamClosed, *BROKEN_FRAME) as exc:
            raise UnavailableError(f"connection to shard {self.address} broken ({type(exc).__name__}: {exc})",
                                   "UNAVAILABLE") from exc

    def _once(self, worker_id: str, request: ps_pb2.FramedRequest, tensors: Sequence[Slice],
              destination: Destination | None, wait_s: float) -> tuple[ps_pb2.FramedReply, list[Array]]:
        if self._sock is None:
            self._sock = self._connect(worker_id)
        sock = self._sock
        try:
            sock.settimeout(self._call_timeout_s)
            message = ps_pb2.FramedRequest()
            message.CopyFrom(request)  # sending lists the tensors in the message: the caller's stays as it was
            send_frame(sock, message, tensors)
            deadline = time.monotonic() + self._call_timeout_s + wait_s
            reply, places = read_head(sock, ps_pb2.FramedReply.FromString, "reply", MAX_FRAME_BYTES,
                                      deadline=deadline)
            if reply.WhichOneof("kind") == "error":
                raise error_of(reply.error.code, reply.error.message, reply.error.outcome)
            if places and destination is None:
                raise FrameError(f"shard {self.address} answered {request.WhichOneof('kind')} with tensors")
            arrays = read_payload(sock, places, destination, deadline) if destination is not None else []
        except BaseException:
            self._drop()  # out of step, or an error the shard may have closed on: a fresh one next time
            raise
        return reply, arrays

    def close(self) -> None:
        """Close the connection."""
        with self._lock:
            self._drop()


@dataclass(frozen=True)
class FramedLimits:
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


@dataclass(frozen=True)
class FramedKind:
    """One request kind a channel answers on the data connection: `kind` its name in FramedRequest's
    oneof, `method` the shard gRPC method whose roles it needs (asyncps.net.authz.METHOD_ROLES),
    `handle(request, tensors)` its reply and the reply's tensors; a kind without `tensors` refuses a
    request that carries some."""

    kind: str
    method: str
    handle: Callable[[ps_pb2.FramedRequest, Sequence[Array]], tuple[ps_pb2.FramedReply, Sequence[Slice]]]
    tensors: bool = False


class Session:
    """One accepted connection: its socket, since when it has been waiting on its client, and the
    arrays its requests' tensors land in (kept for the next request of the same shapes)."""

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


class FramedListener:
    """A shard's data port: framed connections, their handshake and limits, and every request kind
    the channels offered (`kinds`), answered by the kind's handler."""

    def __init__(self, kinds: Mapping[str, FramedKind], security: SecurityConfig | None = None,
                 host: str = LOOPBACK_HOST, port: int = 0, limits: FramedLimits | None = None) -> None:
        self._kinds = dict(kinds)
        self._security = security or SecurityConfig()
        self._limits = limits or FramedLimits()
        self._tokens = (TokenRoles(self._security.token, self._security.chief_token, self._security.shared_token)
                        if self._security.token else None)
        self._tls = self._security.ssl_server_context()
        self._listener = socket.create_server((host, port), backlog=128, reuse_port=False)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._sessions: dict[int, Session] = {}
        self._stopping = threading.Event()
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"data-accept-{self.port}", daemon=True)

    def start(self) -> FramedListener:
        """Start accepting connections."""
        self._acceptor.start()
        log.info("data port %d (%s, at most %d connections; %s)", self.port, "TLS" if self._tls else "plaintext",
                 self._limits.max_connections, ", ".join(self._kinds))
        return self

    def stop(self) -> None:
        """Stop accepting and end every connection."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            sessions = list(self._sessions.values())
        for session in sessions:
            session.evict()
        self._acceptor.join(timeout=5.0)

    @property
    def connections(self) -> int:
        """Connections open now."""
        with self._lock:
            return len(self._sessions)

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, address = self._listener.accept()
            except OSError:
                if self._stopping.is_set():
                    return
                continue
            session = Session(sock, f"{address[0]}:{address[1]}")
            if not self._admit(session):
                log.warning("data port full (%d connections, none idle): refused %s", self._limits.max_connections,
                            session.peer)
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(session,), name=f"data-{session.peer}", daemon=True).start()

    def _admit(self, session: Session) -> bool:
        """Take a slot, evicting the connection that has waited on its client longest when full."""
        victim = None
        with self._lock:
            if len(self._sessions) >= self._limits.max_connections:
                idle = [c for c in self._sessions.values() if c.waiting_since is not None]
                if not idle:
                    return False
                victim = min(idle, key=lambda c: c.waiting_since or 0.0)
                del self._sessions[id(victim)]
            self._sessions[id(session)] = session
        if victim is not None:
            log.warning("data port full: evicted %s (idle %.1fs) for %s", victim.peer,
                        time.monotonic() - (victim.waiting_since or 0.0), session.peer)
            victim.evict()
        return True

    def _serve(self, session: Session) -> None:
        sock = session.sock
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            handshake_deadline = time.monotonic() + self._limits.handshake_timeout_s
            if self._tls is not None:
                sock.settimeout(self._limits.handshake_timeout_s)
                sock = session.sock = self._tls.wrap_socket(sock, server_side=True)
            roles = self._hello(session, sock, handshake_deadline)
            if roles is not None:
                self._requests(session, sock, roles)
        except (OSError, StreamClosed, ssl.SSLError) as exc:
            log.debug("data connection %s ended: %s", session.peer, exc)
        except Exception:
            log.exception("data connection %s failed", session.peer)
        finally:
            with self._lock:
                self._sessions.pop(id(session), None)
            with contextlib.suppress(OSError):
                sock.close()

    def _hello(self, session: Session, sock: socket.socket, deadline: float) -> frozenset[str] | None:
        """The caller's roles from its hello (token, certificate), or None after an error reply."""
        try:
            request, places = read_head(sock, ps_pb2.FramedRequest.FromString, "hello", _HELLO_BYTES, _HELLO_BYTES,
                                        deadline)
            if request.WhichOneof("kind") != "hello" or places:
                raise FrameError("the first request on a data connection is a hello without tensors")
            roles = self._roles(request.hello.token, sock)
        except (*BROKEN_FRAME, UnauthenticatedError, TimeoutError) as exc:
            reply_error(sock, exc if not isinstance(exc, TimeoutError) else UnauthenticatedError("no hello in time"))
            log.warning("data connection %s refused: %s", session.peer, exc)
            return None
        send_frame(sock, ps_pb2.FramedReply(hello=True))
        log.info("data connection from %s (%s)", session.peer, request.hello.worker_id or "?")
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

    def _requests(self, session: Session, sock: socket.socket, roles: frozenset[str]) -> None:
        limits = self._limits
        while not self._stopping.is_set():
            if session.waiting_since is None:  # (set before the last reply went out: see below)
                session.waiting_since = time.monotonic()
            try:
                kind, request, arrays = self._read_request(session, sock)
            except (*BROKEN_FRAME, TimeoutError) as exc:
                if isinstance(exc, TimeoutError) and session.waiting_since is not None:
                    log.info("data connection %s idle for %.0fs: closed", session.peer, limits.idle_timeout_s)
                    return
                reply_error(sock, exc if not isinstance(exc, TimeoutError) else InvalidArgumentError(
                    f"the request's bytes did not arrive within {limits.idle_timeout_s:g}s"))
                log.warning("data connection %s: %s; closed", session.peer, exc)
                return
            try:
                reply, tensors = self._answer(kind, request, arrays, roles)
            except Exception as exc:
                session.waiting_since = time.monotonic()
                reply_error(sock, exc)
                continue
            sock.settimeout(limits.idle_timeout_s)  # a client that does not read its reply is idle too
            # waiting on its client from before the reply leaves: once the client holds the answer, the
            # connection must already count as idle (eviction picks the connection idle longest)
            session.waiting_since = time.monotonic()
            send_frame(sock, reply, tensors)

    def _read_request(self, session: Session, sock: socket.socket
                      ) -> tuple[FramedKind, ps_pb2.FramedRequest, list[Array]]:
        """The next request, its kind and its tensors (received into the session's arrays)."""
        limits = self._limits

        def working() -> None:
            session.waiting_since = None

        idle_deadline = (session.waiting_since or time.monotonic()) + limits.idle_timeout_s
        # idle until a request's first byte, which may come just before the idle deadline (a worker
        # held by sync on another shard for as long): then the rest follows promptly
        request, places = read_head(sock, ps_pb2.FramedRequest.FromString, "request", limits.max_request_bytes,
                                    deadline=idle_deadline, first_byte=working, then_within_s=limits.idle_timeout_s)
        # the frame's bytes must follow promptly: a slow drip is as idle as silence
        payload_deadline = time.monotonic() + limits.idle_timeout_s
        name = request.WhichOneof("kind") or "none"
        kind = self._kinds.get(name)
        if kind is None:
            raise FrameError(f"request kind {name}: " + ", ".join(self._kinds))
        arrays = read_payload(sock, places, lambda chunk: self._destination(session, chunk), payload_deadline)
        return kind, request, arrays

    def _answer(self, kind: FramedKind, request: ps_pb2.FramedRequest, arrays: Sequence[Array],
                roles: frozenset[str]) -> tuple[ps_pb2.FramedReply, Sequence[Slice]]:
        """The kind's reply, once the hello's roles allow its method and its tensors are as it says."""
        allowed = METHOD_ROLES.get(f"/{SHARD_SERVICE}/{kind.method}", frozenset())
        if not roles & allowed:
            raise PermissionDeniedError(f"{kind.method} needs the {'+'.join(sorted(allowed)) or 'no'} role; "
                                        f"this connection's hello grants {'+'.join(sorted(roles)) or 'no role'}")
        if request.tensors and not kind.tensors:
            raise InvalidArgumentError(f"a {kind.kind} request carries no tensors")
        return kind.handle(request, arrays)

    def _destination(self, session: Session, chunk: tensor_pb2.TensorChunk) -> Array:
        """A per-connection array for a request's tensor, reused by the next request of its shape."""
        if chunk.role not in ROLES:
            raise FrameError(f"{chunk.name}: unknown tensor role {chunk.role}")
        try:
            dtype = dtype_from_proto(chunk.dtype)
            nbytes = _checked_nbytes(chunk.shape, dtype, self._limits.max_request_bytes)
        except Exception as exc:  # InvalidArgumentError, ResourceExhaustedError: larger than a request may be
            raise FrameError(f"{chunk.name}: {exc}") from None
        if nbytes != chunk.nbytes:
            raise FrameError(f"{chunk.name}: {chunk.nbytes} bytes for a {dtype}{list(chunk.shape)} tensor of {nbytes}")
        shape = tuple(int(d) for d in chunk.shape)
        key = (chunk.name, int(chunk.role), int(chunk.dtype), shape)
        array = session.buffers.get(key)
        if array is None:
            if sum(a.nbytes for a in session.buffers.values()) + nbytes > self._limits.max_request_bytes:
                session.buffers.clear()  # another model or sparse rows of another size: start over
            array = session.buffers[key] = np.empty(shape, dtype)
        return array


def reply_error(sock: socket.socket, exc: BaseException) -> None:
    """Answer a request with its error, typed as over gRPC (INTERNAL: logged here, no detail sent)."""
    code = status_of(exc) if isinstance(exc, Exception) else grpc.StatusCode.INTERNAL
    if code is grpc.StatusCode.INTERNAL:
        log.error("data request failed unexpectedly", exc_info=exc)
        message = f"internal error ({type(exc).__name__}); see the shard's log"
    else:
        message = str(exc)[:1000]
    try:
        sock.settimeout(1.0)  # a client that does not read its error does not hold this thread
        send_frame(sock, ps_pb2.FramedReply(error=ps_pb2.FramedError(code=code.value[0], message=message,
                                                                     outcome=outcome_name(exc))))
    except OSError:
        pass


__all__ = ["DEFAULT_CONNECT_TIMEOUT_S", "DEFAULT_HANDSHAKE_TIMEOUT_S", "DEFAULT_MAX_CONNECTIONS",
           "DEFAULT_MAX_REQUEST_BYTES", "DataPortUnavailable", "Destination", "FramedConnection", "FramedKind",
           "FramedLimits", "FramedListener", "Session", "certificate_roles", "client_context", "reply_destination",
           "reply_error"]
