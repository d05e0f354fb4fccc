"""gRPC plumbing shared by every role: server factory, channels, error mapping, retries."""

from __future__ import annotations

import functools
import inspect
import logging
import random
import threading
import time
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
)


# Outcomes that steer a client, typed beside the status code as trailing metadata: the client reads
# the kind back with outcome_of, never from the message text (which is for people).
OUTCOME_KEY = "asyncps-outcome"
_OUTCOME_OF: tuple[tuple[type[errors.AsyncpsError], str], ...] = (
    (errors.PathNotVisibleError, "path-not-visible"),
    (errors.AttachAgainError, "attach-again"),
    (errors.NonFiniteGradientError, "non-finite"),
)


def outcome_of(exc: BaseException) -> type[errors.AsyncpsError] | None:
    """The typed outcome a failed call carries (e.g. errors.PathNotVisibleError), None when it has none."""
    if not isinstance(exc, grpc.Call):
        return None
    for key, value in exc.trailing_metadata() or ():
        if key == OUTCOME_KEY:
            for kind, name in _OUTCOME_OF:
                if value == name:
                    return kind
    return None


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
    of the typed outcome's kind when `outcome` names one that status code carries."""
    for typed, name in _OUTCOME_OF:
        if name == outcome and status_of(typed(message)).value[0] == code:
            return typed(message)
    for kind, status in _STATUS_OF:
        if status.value[0] == code and issubclass(kind, errors.AsyncpsError):
            return kind(message)
    return errors.InternalError(message)


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


# how long a peer may fail before the retries say so (once per call): a wrong address or a dead peer is
# reported within seconds, while the call keeps trying until its deadline
UNREACHABLE_WARNING_S = 3.0


class Unreachable(ConnectionError):
    """A peer stayed UNAVAILABLE until the caller's overall deadline."""


def call_with_retry(
    fn: Callable[[], T],
    what: str,
    deadline_s: float,
    retry_codes: Sequence[grpc.StatusCode] = (grpc.StatusCode.UNAVAILABLE,),
    initial_backoff_s: float = 0.05,
    max_backoff_s: float = 2.0,
    rng: random.Random | None = None,
    warn_after_s: float = UNREACHABLE_WARNING_S,
    abort: threading.Event | None = None,
) -> T:
    """Call fn, retrying only the given codes with exponential backoff and full jitter.

    Once the peer has failed for warn_after_s, logs one WARNING naming `what` while the retries go
    on (a wrong address or a peer that is down shows within seconds, not at the deadline), and one
    INFO line if it answers after all. Raises Unreachable naming `what` once deadline_s has passed;
    other errors propagate at once. `abort` (the caller's stop event) ends the retries early: once it
    is set, a failed attempt raises Unreachable at once (a stopping worker does not wait out the deadline
    of a shard that went away with the chief).
    """
    rng = rng or random.Random()
    started = time.monotonic()
    give_up = started + deadline_s
    backoff = initial_backoff_s
    warned = False
    while True:
        try:
            result = fn()
            if warned:
                log.info("reached %s after %.1fs", what, time.monotonic() - started)
            return result
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            if code not in retry_codes:
                raise
            now = time.monotonic()
            left = give_up - now
            detail = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            if left <= 0:
                raise Unreachable(
                    f"could not reach {what} within {deadline_s:.0f}s ({code.name if code else '?'}: "
                    f"{detail})"
                ) from exc
            if abort is not None and abort.is_set():
                raise Unreachable(f"gave up on {what} after {now - started:.1f}s: stopping "
                                  f"({code.name if code else '?'}: {detail})") from exc
            if not warned and now - started >= warn_after_s:
                warned = True
                log.warning("cannot reach %s for %.1fs (%s: %s); still trying, for up to %.0fs more", what,
                            now - started, code.name if code else "?", detail, left)
            # wake for the warning on time even in a long backoff
            pause = rng.uniform(0, backoff)
            if not warned:
                pause = min(pause, max(0.0, started + warn_after_s - now))
            if abort is not None:
                abort.wait(min(left, pause))
            else:
                time.sleep(min(left, pause))
            backoff = min(max_backoff_s, backoff * 2)
