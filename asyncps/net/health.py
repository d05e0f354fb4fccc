"""The standard gRPC health service (grpc.health.v1.Health: Check and Watch), our own implementation.

It answers exactly as grpcio-health-checking's reference servicer does, so grpc_health_probe, the
kubelet's `grpc:` probes and `asyncps health` work unchanged, without that package: its newest releases
require a protobuf newer than TensorFlow 2.16 allows, so pip would upgrade the user's protobuf beside an
older TensorFlow. The messages are proto/asyncps/pb/health.proto's (compiled into asyncps/pb like the
others), or grpcio-health-checking's own where that package imports: both define the same protobuf
names, which one process may register only once, so asyncps never registers a second copy.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

import grpc

SERVICE_NAME = "grpc.health.v1.Health"
OVERALL = ""  # the service name that stands for the whole server


def _messages() -> ModuleType:
    """grpcio-health-checking's health_pb2 where it imports (then it owns the names), else ours."""
    try:
        return importlib.import_module("grpc_health.v1.health_pb2")
    except Exception:  # absent, or built for another protobuf (it then fails before registering anything)
        return importlib.import_module("asyncps.pb.health_pb2")


if TYPE_CHECKING:
    from typing import TypeAlias

    from asyncps.pb import health_pb2

    Status: TypeAlias = health_pb2.HealthCheckResponse.ServingStatus.ValueType
else:
    health_pb2 = _messages()

SERVING: Status = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING: Status = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN: Status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthServicer:
    """The status of each service, for Check and Watch; set() changes one, enter_graceful_shutdown() all.

    Starts with the whole server ("") SERVING. Watch streams the status now and then every change
    (SERVICE_UNKNOWN for a service not set yet) until the caller leaves or the server stops; each
    watch holds one server thread, which the server's StreamGuard bounds like any other stream.
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._status: dict[str, Status] = {OVERALL: SERVING}
        self._version = 0  # bumped by every change, so that a watcher sees each one once
        self._shutting_down = False

    def set(self, service: str, status: Status) -> None:
        """Set one service's status (ignored once the server is shutting down)."""
        with self._changed:
            if self._shutting_down:
                return
            self._status[service] = status
            self._version += 1
            self._changed.notify_all()

    def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING from now on, for good: probes stop routing here while calls drain."""
        with self._changed:
            for service in self._status:
                self._status[service] = NOT_SERVING
            self._shutting_down = True
            self._version += 1
            self._changed.notify_all()

    def status(self, service: str = OVERALL) -> Status | None:
        """The status of service, None when it was never set."""
        with self._changed:
            return self._status.get(service)

    def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext,
              ) -> health_pb2.HealthCheckResponse:
        """The service's status; NOT_FOUND for a service never set."""
        status = self.status(request.service)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext,
              ) -> Iterator[health_pb2.HealthCheckResponse]:
        """The service's status now, then each change, until the caller cancels or the server stops."""
        def wake() -> None:
            with self._changed:
                self._changed.notify_all()

        context.add_callback(wake)  # the caller left, or the server is stopping
        seen = -1
        sent: Status | None = None
        while True:
            with self._changed:
                while self._version == seen and context.is_active():
                    self._changed.wait()
                if not context.is_active():
                    return
                seen = self._version
                status = self._status.get(request.service, SERVICE_UNKNOWN)
            if status != sent:
                sent = status
                yield health_pb2.HealthCheckResponse(status=status)


def add_to_server(servicer: HealthServicer, server: grpc.Server) -> None:
    """Serve servicer as grpc.health.v1.Health on server."""
    request = health_pb2.HealthCheckRequest.FromString
    reply = health_pb2.HealthCheckResponse.SerializeToString
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
        "Check": grpc.unary_unary_rpc_method_handler(
            servicer.Check, request_deserializer=request, response_serializer=reply),
        "Watch": grpc.unary_stream_rpc_method_handler(
            servicer.Watch, request_deserializer=request, response_serializer=reply),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def check(channel: grpc.Channel, service: str = OVERALL, timeout_s: float = 3.0) -> Status:
    """Ask the server behind channel for service's status (raises grpc.RpcError as the call fails)."""
    call = channel.unary_unary(
        f"/{SERVICE_NAME}/Check",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )
    reply: health_pb2.HealthCheckResponse = call(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    return reply.status


def watch(channel: grpc.Channel, service: str = OVERALL,
          timeout_s: float | None = None) -> Iterator[health_pb2.HealthCheckResponse]:
    """Stream service's status from the server behind channel: now, then each change (cancel to stop)."""
    call = channel.unary_stream(
        f"/{SERVICE_NAME}/Watch",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )
    replies: Iterator[health_pb2.HealthCheckResponse] = iter(call(health_pb2.HealthCheckRequest(service=service),
                                                                    timeout=timeout_s))
    return replies
