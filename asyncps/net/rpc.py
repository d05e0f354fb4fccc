"""gRPC plumbing shared by every role: server factory, channels, and the one error table (domain errors
<-> status codes, both directions: servers raise status codes from it, clients domain errors)."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from typing import Any, TypeVar

import grpc

from asyncps import errors
from asyncps.net import health
from asyncps.net.streamguard import StreamGuard, StreamLimits

log = logging.getLogger(__name__)

# Large enough for any single chunk plus headers; tensors themselves always travel chunked.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_STATUS_MESSAGE_BYTES = 1000  # ASCII, so far below gRPC's metadata limits

_STATUS_OF: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (errors.NotFoundError, grpc.StatusCode.NOT_FOUND),
    (errors.InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.AlreadyExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (errors.ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
    (errors.PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (errors.AbortedError, grpc.StatusCode.ABORTED),
    (errors.UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (errors.DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.UnimplementedError, grpc.StatusCode.UNIMPLEMENTED),
    (errors.InternalError, grpc.StatusCode.INTERNAL),
)
_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


# Outcomes that steer a client, typed beside the status code as trailing metadata: the client reads
# the kind back with error_from_rpc, never from the message text (which is for people).
OUTCOME_KEY = "asyncps-outcome"
_OUTCOME_OF: tuple[tuple[type[errors.AsyncpsError], str], ...] = (
    (errors.PathNotVisibleError, "path-not-visible"),
    (errors.AttachAgainError, "attach-again"),
    (errors.NonFiniteGradientError, "non-finite"),
)


def status_of(exc: Exception) -> grpc.StatusCode:
    """The status code a domain error maps to; anything unexpected is INTERNAL."""
    for kind, code in _STATUS_OF:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def outcome_name(exc: BaseException) -> str:
    """The name of the typed outcome an error carries ("" when it has none): what OUTCOME_KEY sends."""
    for kind, name in _OUTCOME_OF:
        if isinstance(exc, kind):
            return name
    return ""


def error_of(code: int, message: str, outcome: str = "") -> errors.AsyncpsError:
    """The domain error a status code number names (the inverse of status_of; InternalError else),
    of the typed outcome's kind when `outcome` names one that status code carries; it carries the
    code's name and the message."""
    name = _CODE_NAMES.get(code, "UNKNOWN")
    for typed, outcome_name_ in _OUTCOME_OF:
        if outcome_name_ == outcome and status_of(typed(message)).value[0] == code:
            return typed(message, name)
    for kind, status in _STATUS_OF:
        if status.value[0] == code and issubclass(kind, errors.AsyncpsError):
            return kind(message, name)
    return errors.InternalError(message, name)


F = TypeVar("F", bound=Callable[..., Any])


def _abort(context: grpc.ServicerContext, method: str, exc: Exception) -> None:
    code = status_of(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("%s failed unexpectedly", method)
        context.abort(code, f"{method}: internal error ({type(exc).__name__}); see the server log")
    message = str(exc)
    if len(message.encode()) > MAX_STATUS_MESSAGE_BYTES or not message.isascii():
        # Messages quote client-supplied names; gRPC percent-encodes non-ASCII and drops a status
        # whose metadata is too large, so keep it short and ASCII (escapes for the rest).
        escaped = message.encode("ascii", "backslashreplace").decode()
        if len(escaped) > MAX_STATUS_MESSAGE_BYTES:
            escaped = escaped[:MAX_STATUS_MESSAGE_BYTES] + f"... ({len(escaped)} characters, truncated)"
        message = escaped
    log.info("%s -> %s: %s", method, code.name, message)
    outcome = outcome_name(exc)
    if outcome:
        context.set_trailing_metadata(((OUTCOME_KEY, outcome),))
    context.abort(code, message)


def handles_errors(method: F) -> F:
    """Turn domain exceptions raised by a servicer method into a gRPC status and message."""
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                yield from method(self, request, context)
            except Exception as exc:
                _abort(context, method.__name__, exc)

        return stream  # type: ignore[return-value]

    @functools.wraps(method)
    def unary(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except Exception as exc:
            _abort(context, method.__name__, exc)
            raise  # unreachable: abort raises

    return unary  # type: ignore[return-value]


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """Channel arguments used by every server."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """Channel arguments used by every client."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.enable_retries", 0),  # retries are ours: only UNAVAILABLE, with backoff and jitter
        # one connection per client object, as if it were its own process: the servers bound streams
        # per connection (asyncps.net.streamguard), and logical workers or load generators in one process
        # would otherwise share one connection and its limit
        ("grpc.use_local_subchannel_pool", 1),
    ]


def create_server(
    address: str,
    register: Sequence[Callable[[grpc.Server], None]],
    max_workers: int = 32,
    interceptors: Sequence[grpc.ServerInterceptor[Any, Any]] = (),
    credentials: grpc.ServerCredentials | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    stream_limits: StreamLimits | None = None,
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Build a started server with the standard health service; return it and its bound port.

    Streaming calls are bounded by a StreamGuard (stream_limits, else those of max_workers
    threads), placed after the given interceptors so that refused callers never count.
    """
    guard = StreamGuard(stream_limits or StreamLimits.for_threads(max_workers))
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
        interceptors=[*interceptors, guard],
        options=server_options(max_message_bytes),
    )
    for add in register:
        add(server)
    health_servicer = health.HealthServicer()
    health.add_to_server(health_servicer, server)
    port = server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    if port == 0:
        raise OSError(f"could not bind {address}")
    server.start()
    health_servicer.set(health.OVERALL, health.SERVING)
    return server, port, health_servicer


def serve_health(address: str, servicer: health.HealthServicer) -> tuple[grpc.Server, int]:
    """A second, plaintext server with only the standard health service of a role's server (the same
    servicer, so both answer alike, NOT_SERVING once it shuts down): for probes that can neither
    speak TLS nor send a token, such as the kubelet's `grpc:` probes. It reveals nothing else."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="health"))
    health.add_to_server(servicer, server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {address}")
    server.start()
    return server, port


def make_channel(
    address: str,
    credentials: grpc.ChannelCredentials | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
) -> grpc.Channel:
    """Open a client channel with the project's options."""
    if credentials is None:
        return grpc.insecure_channel(address, options=channel_options(max_message_bytes))
    return grpc.secure_channel(address, credentials, options=channel_options(max_message_bytes))


T = TypeVar("T")

# The retries' verdict, an asyncps.errors.UnavailableError: also named here, where callers have met it.
Unreachable = errors.Unreachable


def error_from_rpc(exc: grpc.RpcError) -> errors.AsyncpsError:
    """The domain error a failed gRPC call stands for: its status code through the one table, its
    typed outcome (trailing metadata) when it carries one, its code's name and its details."""
    if not isinstance(exc, grpc.Call):
        return errors.InternalError(f"{type(exc).__name__}: {exc}", "UNKNOWN")
    code = exc.code()
    outcome = next((str(value) for key, value in exc.trailing_metadata() or () if key == OUTCOME_KEY), "")
    return error_of(code.value[0] if code is not None else -1, exc.details() or "", outcome)


def raising_domain_errors(fn: Callable[[], T]) -> Callable[[], T]:
    """fn, with a failed gRPC call raised as its domain error (error_from_rpc): a client's edge."""
    def call() -> T:
        try:
            return fn()
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from exc

    return call
