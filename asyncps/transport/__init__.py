"""Transports between clients (workers, the chief, tools) and the parameter-server shards.

`ShardTransport` (base.py) is the seam: domain types in and out. `connect_shard` picks the
implementation for an address; `ModelClient` runs a whole model over any of them.
"""

from __future__ import annotations

from collections.abc import Sequence

from asyncps.codec import DEFAULT_CHUNK_BYTES
from asyncps.placement import Placement
from asyncps.security import SecurityConfig
from asyncps.transport.base import InitResult, ShardTransport
from asyncps.transport.grpc_shard import GrpcShardTransport
from asyncps.transport.model import ModelClient, ShardPush


def connect_shard(
    address: str,
    deadline_s: float = 60.0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    security: SecurityConfig | None = None,
    call_timeout_s: float = 30.0,
) -> ShardTransport:
    """A transport to the shard at `address` (host:port, over gRPC)."""
    return GrpcShardTransport(address, deadline_s, chunk_bytes, security, call_timeout_s)


def connect_model(
    member_id: str,
    addresses: Sequence[str],
    placement: Placement,
    deadline_s: float = 60.0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    security: SecurityConfig | None = None,
) -> ModelClient:
    """A ModelClient over transports to every shard, in shard order."""
    return ModelClient(member_id, [connect_shard(a, deadline_s, chunk_bytes, security) for a in addresses],
                       placement)


__all__ = ["GrpcShardTransport", "InitResult", "ModelClient", "ShardPush", "ShardTransport", "connect_model",
           "connect_shard"]
