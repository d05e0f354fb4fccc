"""Transports between clients (workers, the chief, tools) and the parameter-server shards.

The seam has two faces (base.py): a per-step `DataPath` (pull, push, push-pull) and the
`ShardControl` face (initialize, stats, pause/hold, snapshot, restore, live workers, shutdown),
always gRPC. `ShardClient` pairs them per shard; `connect_shard` builds one from the registry of
transports (registry.py), which configuration and `--transport` read too; `ModelClient` runs a
whole model over any of them.

Adding a transport (a channel, say "tcp"), three files and nothing else:
1. the client: `asyncps/transport/tcp.py` with a `DataPath` and its factory
   `tcp_data_path(setup: ClientSetup, fallback: DataPath | None, required: bool) -> DataPath`
   (`setup.link` is the shard's gRPC link; a lean channel opens its framed connection with
   `link.data_connection(setup.link, setup.security)` (asyncps.net.framed: framing, hello, token,
   TLS, limits, reconnects) and sends its request kinds over it; hand calls it cannot carry to
   `fallback`; raise where `required` and the path cannot be set up);
2. the shard adapter: `ps/tcp.py` with a factory `(ShardSide) -> ShardAdapter` over the shard's
   one `ShardService` (asyncps.ps.adapter): the gRPC methods it answers (tcp: none), start and close,
   and the request kinds it answers on the framed data connection (`side.offer(FramedKind(...))`,
   beside every other channel's: shm offers its doorbell, `mapped`, exactly so); the shard's data
   port (asyncps.ps.dataport: DataPort, the listener, `--data-port`, `--max-data-connections`, the
   registry's DATA_CONNECTION_SETTINGS) serves every kind offered, so no channel starts it;
3. one entry in registry.py: `Transport("tcp", "<one-line help>", tcp_data_path,
   "asyncps.ps.tcp:TcpAdapter", unavailable=..., auto_rank=..., shard_settings=(ShardSetting(
   "--<name>-knob", 1, "<help>", check), ...), model_buffers=...)`; the adapter reads its own settings
   as side.setting("<name>_knob"); `model_buffers` (shm's arena) is where connect_model puts the model.
connect_shard, connect_model, RunConfig.transport's validation, `--transport`'s help, "auto", the
shard's start (asyncps.ps.main) and `asyncps ps`'s flags and ASYNCPS_* variables then pick it up.
A request kind of its own is one more field of FramedRequest's oneof (proto/asyncps/pb/ps.proto).
Outcomes that steer a client (fall back, attach again) are asyncps.errors classes carried typed by
asyncps.net.rpc (error_from_rpc), never message text.

Errors: every path, and the control face, fails with asyncps.errors only (each converts at its own
edge: the gRPC link through asyncps.net.rpc's one table, the framed connection from its error
replies and broken connections), retried by one asyncps.net.retry.RetryPolicy; nothing above the
seam sees a grpc.RpcError.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence

from asyncps.net.security import SecurityConfig
from asyncps.placement import Placement
from asyncps.transport import shmseg
from asyncps.transport.base import (
    ClientSetup,
    DataPath,
    InitResult,
    ModelBuffers,
    ShardClient,
    ShardControl,
    ShardTransport,
)
from asyncps.transport.grpc_shard import FramesDataPath, GrpcShardControl, GrpcShardTransport
from asyncps.transport.link import ShardLink
from asyncps.transport.model import ModelClient, ShardPush
from asyncps.transport.registry import AUTO, TRANSPORTS, Transport, TransportRegistry
from asyncps.transport.shm import ShmDataPath, arena_bytes
from asyncps.wire.codec import DEFAULT_CHUNK_BYTES


def connect_shard(
    address: str,
    deadline_s: float = 60.0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    security: SecurityConfig | None = None,
    call_timeout_s: float = 30.0,
    transport: str = "grpc",
    registry: TransportRegistry = TRANSPORTS,
    ride_restarts: bool = True,
    abort: threading.Event | None = None,
    model_buffers: ModelBuffers | None = None,
) -> ShardClient:
    """A client to the shard at `address` (host:port): the gRPC control face paired with the data
    path the `transport` setting names in the registry ("auto": the best available path, each
    falling back to the next; a name: that path required, e.g. "shm" is an error on another host).
    `ride_restarts`: training calls wait while the shard restarted empty (a worker's), or fail at once
    with FailedPreconditionError (the chief's: it is the one that restores the shard). `abort`: the owner's
    stop event; once it is set, a call that fails is not retried (Unreachable at once). `model_buffers`:
    where the worker's model lives, for a path that provided them (see connect_model)."""
    link = ShardLink(address, deadline_s, security, call_timeout_s, ride_restarts=ride_restarts, abort=abort)
    try:
        data = registry.data_path(transport, ClientSetup(link, chunk_bytes, security, model_buffers))
    except BaseException:
        link.close()
        raise
    return ShardClient(GrpcShardControl(link, chunk_bytes), data)


def connect_model(
    worker_id: str,
    addresses: Sequence[str],
    placement: Placement,
    deadline_s: float = 60.0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    security: SecurityConfig | None = None,
    transport: str = "grpc",
    worker_index: int | None = None,
    coordinated: bool = False,
    ride_restarts: bool = True,
    abort: threading.Event | None = None,
    registry: TransportRegistry = TRANSPORTS,
    row_variables: Collection[str] = (),
) -> ModelClient:
    """A ModelClient over transports to every shard, in shard order (see connect_shard); a worker's
    client sends its index with every push, and a coordinated one (a sync run's worker) has shard 0
    decide each step for every shard. `ride_restarts`, `abort`: see connect_shard. The model's
    buffers come from the transport's registry entry when it provides them (Transport.model_buffers:
    shm's arena, which every shard on this host writes its values into, rows of sliced variables
    included; never the tables read by rows, `row_variables`: see ModelClient)."""
    buffers = registry.model_buffers(transport, placement.without(row_variables), len(addresses))
    try:
        shards = [connect_shard(a, deadline_s, chunk_bytes, security, transport=transport, registry=registry,
                                ride_restarts=ride_restarts, abort=abort, model_buffers=buffers) for a in addresses]
    except BaseException:
        if buffers is not None:
            buffers.close()
        raise
    return ModelClient(worker_id, shards, placement, worker_index, coordinated, buffers, row_variables)


__all__ = ["AUTO", "TRANSPORTS", "ClientSetup", "DataPath", "FramesDataPath", "GrpcShardControl",
           "GrpcShardTransport", "InitResult", "ModelBuffers", "ModelClient", "ShardClient", "ShardControl",
           "ShardLink", "ShardPush", "ShardTransport", "ShmDataPath", "Transport", "TransportRegistry", "arena_bytes",
           "connect_model", "connect_shard", "shmseg"]
