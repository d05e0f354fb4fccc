"""The shard's framed data port: one listener (asyncps.net.framed) serving every request kind the
channels' adapters offer on ShardSide (tcp's pull, push and push-pull, shm's doorbell `mapped`),
and the DataPort call that tells workers where it listens.

It belongs to the connection layer, not to a channel: asyncps.ps.main.shard_adapters builds it
once, after every channel's adapter has offered its kinds, so no channel's shard adapter needs
another's. Its two settings are the data connection's, declared in asyncps.transport.registry
(DATA_CONNECTION_SETTINGS): data_port (`asyncps ps --data-port`; 0: any free port; -1: none, DataPort
answers 0 and workers fall back to gRPC frames) and max_data_connections.
"""

from __future__ import annotations

import logging
import os
import threading

import grpc
from asyncps.ps.adapter import AdapterStartError, ShardSide

from asyncps.net.framed import FramedLimits, FramedListener
from asyncps.net.handlers import Handler
from asyncps.pb import ps_pb2

log = logging.getLogger(__name__)


class DataPortAdapter:
    """The shard's data port (a ShardAdapter): DataPort over gRPC and the listener over every
    channel's offered kinds (none offered: no listener, DataPort answers 0)."""

    def __init__(self, side: ShardSide) -> None:
        self._side = side
        self._lock = threading.Lock()
        self._server: FramedListener | None = None

    @property
    def port(self) -> int:
        """Where the data port listens; 0 before start, after close or with none."""
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
        """Bind and serve the data port (nothing with data_port -1 or no kind offered)."""
        side = self._side
        data_port = int(side.setting("data_port"))
        if data_port < 0 or not side.framed_kinds:
            why = "--data-port -1" if data_port < 0 else "no channel offers a request kind"
            log.info("shard %d: no data port (%s): workers use gRPC frames", side.service.shard_index, why)
            return
        limits = FramedLimits(int(side.setting("max_data_connections")), side.idle_timeout_s,
                              max_request_bytes=side.framed_request_bytes)
        try:
            server = FramedListener(side.framed_kinds, side.security, side.host, data_port, limits).start()
        except OSError as exc:
            why = os.strerror(exc.errno) if exc.errno else str(exc)
            raise AdapterStartError(f"the data port {side.host}:{data_port} cannot be bound ({why}): give "
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


__all__ = ["DataPortAdapter"]
