"""Transports between clients (workers, the chief, tools) and the parameter-server shards.

`ShardTransport` (base.py) is the seam: domain types in and out. `connect_shard` picks the
implementation for an address; `ModelClient` runs a whole model over any of them.
"""

from __future__ import annotations

from collections.abc import Sequence

from asyncps.net.security import SecurityConfig
from asyncps.placement import Placement
from asyncps.transport import shmseg
from asyncps.transport.base import InitResult, ShardTransport
from asyncps.transport.grpc_shard import GrpcShardTransport
from asyncps.transport.model import ModelClient, ShardPush
from asyncps.transport.shm import MODES as _SHM_MODES
from asyncps.transport.shm import ShmShardTransport
from asyncps.transport.tcp import TcpShardTransport
from asyncps.wire.codec import DEFAULT_CHUNK_BYTES

MODES = (*_SHM_MODES, "tcp")


def connect_shard(
    address: str,
    deadline_s: float = 60.0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    security: SecurityConfig | None = None,
    call_timeout_s: float = 30.0,
    transport: str = "grpc",
) -> ShardTransport:
    """A transport to the shard at `address` (host:port): gRPC frames ("grpc"), shared memory
    for the tensors when the shard can map this process's segments ("auto", else frames), or
    shared memory required ("shm": an error when the shard is on another host), or a TCP data
    connection ("tcp", gRPC frames when the shard's data port cannot be reached)."""
    if transport not in MODES:
        raise ValueError(f"transport {transport!r}: one of {', '.join(MODES)}")
    inner = GrpcShardTransport(address, deadline_s, chunk_bytes, security, call_timeout_s)
    if transport == "tcp":
        return TcpShardTransport(inner, security)
    if transport == "grpc" or (transport == "auto" and not shmseg.available()):
        return inner
    if not shmseg.available():
        raise ValueError(f"transport shm: no writable {shmseg.SHM_DIR} on this host")
    return ShmShardTransport(inner, transport)


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
) -> ModelClient:
    """A ModelClient over transports to every shard, in shard order (see connect_shard); a worker's
    client sends its index with every push, and a coordinated one (a sync run's worker) has shard 0
    decide each step for every shard."""
    return ModelClient(worker_id, [connect_shard(a, deadline_s, chunk_bytes, security, transport=transport)
                                   for a in addresses], placement, worker_index, coordinated)


__all__ = ["MODES", "GrpcShardTransport", "InitResult", "ModelClient", "ShardPush", "ShardTransport",
           "ShmShardTransport", "TcpShardTransport", "connect_model", "connect_shard"]
