"""The transport seam: what the worker and the chief need from one shard, in domain types.

A transport moves tensors and control messages between a client and one shard; the shard's
decisions (versions, staleness, policies, modes, incarnations, validation) never depend on it.
gRPC (asyncps.transport.grpc) is one implementation; protobuf stays inside it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from asyncps.rules import UpdateRuleConfig
from asyncps.rules.sync.types import Decisions, Held
from asyncps.wire.codec import Array
from asyncps.wire.shard import PushOutcome, PushRequest, ShardValues, Snapshot, StoreStats


@dataclass(frozen=True)
class InitResult:
    """The answer to an initialization or a restore."""

    created: bool  # False: an identical initialization already existed
    version: int


class ShardTransport(Protocol):
    """Typed calls to one shard. Errors are asyncps.errors exceptions or the transport's own
    status errors; retries of transient failures happen inside."""

    address: str

    def initialize(
        self, worker_id: str, shard_index: int, num_shards: int, rule: UpdateRuleConfig,
        values: Mapping[str, Array], run_id: str = "",
    ) -> InitResult:
        """Send initial values and the update rule (idempotent on the shard for the same run)."""

    def pull(
        self, worker_id: str, if_newer_than: int = -1, buffers: Mapping[str, Array] | None = None,
        wait_timeout_s: float = 0.0,
    ) -> ShardValues:
        """The shard's values (received into `buffers` where they fit), or None when not newer."""

    def push(self, request: PushRequest) -> PushOutcome:
        """Apply or drop one gradient."""

    def push_pull(
        self, request: PushRequest, pull_if_newer_than: int = -1, buffers: Mapping[str, Array] | None = None,
        read_wait_s: float = 0.0,
    ) -> tuple[PushOutcome, ShardValues]:
        """Push, then receive the values in the same round trip (held up to read_wait_s by sync/ssp)."""

    def stats(self, deadline_s: float | None = None) -> StoreStats:
        """The shard's counters and variable metadata."""

    def pause(self, hold_s: float) -> int:
        """Hold pushes for up to hold_s seconds (0: release); returns the shard's version."""

    def hold(self, hold_s: float, decisions_since: int = -1, sync: Decisions | None = None) -> Held:
        """A pause that, in multi-shard sync, also reads the coordinator's decisions for steps >=
        decisions_since or commits `sync` on a held follower (a consistent cut, chief only)."""

    def snapshot(self) -> Snapshot:
        """The shard's whole state (values, slots, counters)."""

    def restore(self, snap: Snapshot, shard_index: int) -> InitResult:
        """Replace the shard's state with a checkpoint's part."""

    def set_live_workers(self, worker_ids: Sequence[str]) -> None:
        """Tell the shard which workers are alive."""

    def shutdown(self, reason: str, deadline_s: float = 5.0) -> None:
        """Ask the shard process to exit."""

    def close(self) -> None:
        """Release the connection."""


__all__ = ["InitResult", "PushRequest", "ShardTransport"]
