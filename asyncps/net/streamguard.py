"""Bounded streams: stalled or slow clients cannot occupy a server's handler threads.

gRPC's synchronous server gives each call a thread from the moment it starts, and a streaming
call keeps it while the handler waits for the client's next message (a stalled upload) or for
the client to read a reply (a slow download). The StreamGuard interceptor bounds that:

* per peer (one client connection): at most max_streams_per_peer streaming calls at once; the
  next one fails at once with RESOURCE_EXHAUSTED;
* server-wide: at most max_streams streaming calls, fewer than the handler threads, so threads
  always stay free for unary calls: control, statistics, the coordinator, health. A streaming
  call that finds the server full evicts the call that has been waiting on its client longest
  (it fails with RESOURCE_EXHAUSTED) and takes its place; only when no call waits on its client
  is the newcomer refused;
* idle: a call that has waited idle_timeout_s on its client fails with RESOURCE_EXHAUSTED.

Time a handler spends on the server's own work (applying a gradient, a long-poll for a new
version) is never "waiting on the client": only reading the next request message and handing a
reply message to a client that does not take it are.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from asyncps.errors import ResourceExhaustedError
from asyncps.net.handlers import Handler, behavior, kind, with_behavior

log = logging.getLogger(__name__)

HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
DEFAULT_IDLE_TIMEOUT_S = 30.0
MAX_STREAMS_PER_PEER = 16  # a worker runs a few calls per shard at once (pipelining), never this many

if TYPE_CHECKING:
    _ServerInterceptor = grpc.ServerInterceptor[Any, Any]
else:  # the runtime class is not generic
    _ServerInterceptor = grpc.ServerInterceptor


@dataclass(frozen=True)
class StreamLimits:
    """How many streaming calls a server admits (all, per peer) and how long one may idle."""

    max_streams: int
    max_streams_per_peer: int
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.max_streams < 1 or self.max_streams_per_peer < 1:
            raise ValueError("stream limits must be at least 1")
        if not self.idle_timeout_s > 0:
            raise ValueError(f"the idle stream timeout must be > 0 seconds, got {self.idle_timeout_s}")

    @classmethod
    def for_threads(cls, handler_threads: int, idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
                    max_streams_per_peer: int = 0) -> StreamLimits:
        """Limits for a server with this many handler threads: a quarter (at least 4) kept free of
        streams; per peer MAX_STREAMS_PER_PEER or half the streams, whichever is less (0: that)."""
        reserve = max(4, handler_threads // 4)
        if handler_threads <= reserve:
            raise ValueError(f"a server needs more than {reserve} handler threads, got {handler_threads}")
        streams = handler_threads - reserve
        per_peer = max_streams_per_peer or max(1, min(MAX_STREAMS_PER_PEER, streams // 2))
        return cls(streams, per_peer, idle_timeout_s)


@dataclass(eq=False)
class _Call:
    """One admitted streaming call."""

    method: str
    peer: str
    context: grpc.ServicerContext
    waiting_since: float | None = None  # when it began waiting on its client; None: not waiting
    ended: bool = False  # cancelled by the guard
    started: float = field(default_factory=time.monotonic)


def _method_name(method: str) -> str:
    return method.rsplit("/", 1)[-1]


def cancel_call(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    """End a call from another thread with a status the client sees (the handler's next read or
    write then fails and its thread returns). grpc's public cancel() sends a bare CANCELLED, so
    the core call's cancel-with-status is used where it exists."""
    core_call: Any = getattr(getattr(context, "_rpc_event", None), "call", None)
    try:
        core_call.cancel(code.value[0], message)
    except (AttributeError, TypeError):
        context.cancel()  # type: ignore[no-untyped-call]


class StreamGuard(_ServerInterceptor):
    """Admits, counts and watches the streaming calls of one server (see the module docstring)."""

    def __init__(self, limits: StreamLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._lock = threading.Lock()
        self._calls: set[_Call] = set()
        self._per_peer: dict[str, int] = {}
        self._watchdog: threading.Thread | None = None
        self.refused = 0
        self.evicted = 0
        self.timed_out = 0

    def __repr__(self) -> str:
        return f"StreamGuard({self.limits})"

    def open_streams(self) -> int:
        """Streaming calls admitted now."""
        with self._lock:
            return len(self._calls)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        """Guard the streaming methods; unary ones and the health service pass untouched."""
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(HEALTH_METHOD_PREFIX) or kind(handler) == (False, False):
            return handler
        return with_behavior(handler, self._guarded(behavior(handler), method, *kind(handler)))

    def _guarded(self, inner: Callable[[Any, grpc.ServicerContext], Any], method: str,
                 request_streaming: bool, response_streaming: bool) -> Callable[[Any, grpc.ServicerContext], Any]:
        def guarded(request: Any, context: grpc.ServicerContext) -> Any:
            call = self._admit(method, context)
            argument = self._watch_requests(request, call) if request_streaming else request
            if not response_streaming:
                try:
                    return inner(argument, context)
                finally:
                    self._release(call)
            try:
                replies = inner(argument, context)
            except BaseException:
                self._release(call)
                raise
            return self._watch_replies(replies, call)

        return guarded

    # -- admission ---------------------------------------------------------------------------
    def _admit(self, method: str, context: grpc.ServicerContext) -> _Call:
        peer = context.peer()
        call = _Call(method, peer, context)
        victim: _Call | None = None
        refusal = ""
        with self._lock:
            open_here = self._per_peer.get(peer, 0)
            if open_here >= self.limits.max_streams_per_peer:
                refusal = (f"{_method_name(method)}: {open_here} streams already open on this connection "
                           f"(limit {self.limits.max_streams_per_peer}); retry when one ends")
            elif len(self._calls) >= self.limits.max_streams:
                waiting = [c for c in self._calls if c.waiting_since is not None and not c.ended]
                if waiting:
                    victim = min(waiting, key=lambda c: c.waiting_since or 0.0)
                    victim.ended = True
                    self.evicted += 1
                else:
                    refusal = (f"{_method_name(method)}: server busy with {len(self._calls)} streams "
                               f"(limit {self.limits.max_streams}); retry later")
            if refusal:
                self.refused += 1
            else:
                self._calls.add(call)
                self._per_peer[peer] = open_here + 1
                if self._watchdog is None:
                    self._watchdog = threading.Thread(target=self._watch, name="stream-guard", daemon=True)
                    self._watchdog.start()
        if victim is not None:
            self._end(victim, f"{_method_name(victim.method)}: evicted after waiting "
                              f"{self._clock() - (victim.waiting_since or 0.0):.1f}s on the client while "
                              f"the server was full ({self.limits.max_streams} streams)")
        if refusal:
            log.warning("refused %s from %s: %s", method, peer, refusal)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        return call

    def _release(self, call: _Call) -> None:
        with self._lock:
            if call in self._calls:
                self._calls.discard(call)
                left = self._per_peer.get(call.peer, 1) - 1
                if left > 0:
                    self._per_peer[call.peer] = left
                else:
                    self._per_peer.pop(call.peer, None)

    def _end(self, call: _Call, message: str) -> None:
        log.warning("ending %s from %s: %s", call.method, call.peer, message)
        cancel_call(call.context, grpc.StatusCode.RESOURCE_EXHAUSTED, message)

    # -- watching ----------------------------------------------------------------------------
    def _watch_requests(self, requests: Iterator[Any], call: _Call) -> Iterator[Any]:
        """The request stream, with the time spent waiting for each message recorded."""
        while True:
            call.waiting_since = self._clock()
            try:
                message = next(requests)
            except StopIteration:
                return
            except grpc.RpcError:
                if call.ended:  # the client already has the reason; the handler ends quietly
                    raise ResourceExhaustedError(f"{_method_name(call.method)}: ended by the stream guard") from None
                raise
            finally:
                call.waiting_since = None
            yield message

    def _watch_replies(self, replies: Iterator[Any], call: _Call) -> Iterator[Any]:
        """The reply stream, with the time until the client takes each message recorded."""
        try:
            for message in replies:
                call.waiting_since = self._clock()
                yield message
                call.waiting_since = None
        finally:
            self._release(call)

    def _watch(self) -> None:
        """End calls idle past the timeout; exit once no stream is open (restarted on demand)."""
        period = min(1.0, self.limits.idle_timeout_s / 4)
        while True:
            time.sleep(period)
            now = self._clock()
            with self._lock:
                if not self._calls:
                    self._watchdog = None
                    return
                idle = [c for c in self._calls if not c.ended and c.waiting_since is not None
                        and now - c.waiting_since > self.limits.idle_timeout_s]
                for c in idle:
                    c.ended = True
                    self.timed_out += 1
            for c in idle:
                self._end(c, f"{_method_name(c.method)}: idle stream, no progress from the client for "
                             f"{self.limits.idle_timeout_s:g}s")
