"""The transport seam, in domain types: a per-step data path and a control face, paired per shard.

A worker's step needs only the `DataPath` (pull, push, push-pull); the chief's calls (initialize,
stats, pause/hold, snapshot, restore, live workers, shutdown) are the `ShardControl` face, always
gRPC. `ShardClient` pairs one of each for one shard and is what callers hold (`ShardTransport` is
its protocol). The shard's decisions (versions, staleness, policies, modes, incarnations,
validation) never depend on the path a tensor took; protobuf stays inside the implementations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from asyncps.rules import UpdateRuleConfig
from asyncps.rules.initializers import TableSpec
from asyncps.rules.sync.types import Decisions, Held
from asyncps.wire.codec import Array, IndexArray
from asyncps.wire.frames import Slice
from asyncps.wire.shard import PushOutcome, PushRequest, ShardValues, Snapshot, StoreStats

if TYPE_CHECKING:
    from asyncps.net.security import SecurityConfig
    from asyncps.transport.link import ShardLink


@dataclass(frozen=True)
class InitResult:
    """The answer to an initialization or a restore."""

    created: bool  # False: an identical initialization already existed
    version: int


class ModelBuffers(Protocol):
    """Where a worker's model values live when a transport provides them (its registry entry's
    `model_buffers` hook, e.g. shm's arena, which the shards map and write into); else they are
    aligned arrays of the worker's own."""

    def array(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Array:
        """A fresh zeroed, aligned, C-contiguous array for one variable."""

    def close(self) -> None:
        """Release the memory (once every path that used it is closed)."""


@dataclass(frozen=True)
class ClientSetup:
    """What a transport's data-path factory is given for one shard: the shard's gRPC link (shared
    with the control face: its channel, deadlines and retry policy), the frame size and the
    cluster's security (a path of its own authenticates and encrypts as gRPC does), and the
    worker's model buffers when a transport provided them (ModelBuffers: a path that made them
    may use them, e.g. shm's arena)."""

    link: ShardLink
    chunk_bytes: int
    security: SecurityConfig | None = None
    model_buffers: ModelBuffers | None = None


class DataPath(Protocol):
    """What a worker does with one shard per step. Errors are asyncps.errors exceptions, whatever the
    path (Unreachable once the retries of transient failures, inside, give up)."""

    def pull(
        self, worker_id: str, if_newer_than: int = -1, buffers: Mapping[str, Array] | None = None,
        wait_timeout_s: float = 0.0, rows: Mapping[str, IndexArray] | None = None,
    ) -> ShardValues:
        """The shard's values (received into `buffers` where they fit), or None when not newer; the parts
        named in `rows` only as those rows (ShardValues.rows, served whatever the version)."""

    def push(self, request: PushRequest) -> PushOutcome:
        """Apply or drop one gradient."""

    def push_pull(
        self, request: PushRequest, pull_if_newer_than: int = -1, buffers: Mapping[str, Array] | None = None,
        read_wait_s: float = 0.0, rows: Mapping[str, IndexArray] | None = None,
    ) -> tuple[PushOutcome, ShardValues]:
        """Push, then receive the values in the same round trip (held up to read_wait_s by sync/ssp); the
        parts named in `rows` as those rows only (see pull)."""

    def close(self) -> None:
        """Release what the path holds (not the shared gRPC channel: the control face owns it)."""


@dataclass
class SnapshotStream:
    """A shard's state as it streams: `header` (its counters and update counts; no arrays), and its
    tensors' `slices` (each a byte range of `value/PART`, `slot/SLOT/PART` or `policy/KEY/PART`, in order
    within a tensor); `cancel` ends the stream early (a cut that failed)."""

    header: Snapshot
    slices: Iterator[Slice]
    cancel: Callable[[], None]


class ShardControl(Protocol):
    """The chief's (and tools') calls to one shard: always gRPC, whatever the data path."""

    address: str

    def initialize(
        self, worker_id: str, shard_index: int, num_shards: int, rule: UpdateRuleConfig,
        values: Mapping[str, Array], run_id: str = "", generated: Mapping[str, TableSpec] | None = None,
        incarnation: int = 0,
    ) -> InitResult:
        """Send initial values and the update rule (idempotent on the shard for the same run); the parts
        in `generated` the shard makes itself from their row initializer (no values sent); `incarnation`:
        the one the state takes (0: the shard draws one)."""

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

    def snapshot_stream(self) -> SnapshotStream:
        """The shard's whole state as it streams: its counters read at once (the shard has copied its
        state by then), its tensors a chunk at a time as the caller reads them."""

    def restore_stream(self, snap: Snapshot, shard_index: int,
                       slices: Callable[[], Iterable[Slice]]) -> InitResult:
        """Replace the shard's state with a checkpoint's part: `snap`'s counters (its arrays ignored) and
        the tensors `slices()` yields (`value/PART`, `slot/SLOT/PART`, `policy/KEY/PART`), sent as read."""

    def set_live_workers(self, worker_ids: Sequence[str]) -> None:
        """Tell the shard which workers are alive."""

    def shutdown(self, reason: str, deadline_s: float = 5.0) -> None:
        """Ask the shard process to exit."""

    def close(self) -> None:
        """Release the connection."""


class ShardTransport(DataPath, ShardControl, Protocol):
    """Both faces to one shard (what ShardClient implements): a worker uses the data path, the
    chief the control face."""


class ShardClient:
    """One shard's client: a control face and a data path paired (the data path may share the
    control face's gRPC channel; closing the client closes the path first, then the control)."""

    def __init__(self, control: ShardControl, data: DataPath) -> None:
        self.control = control
        self.data = data
        self.address = control.address

    # the data path: a worker's per-step calls
    def pull(
        self, worker_id: str, if_newer_than: int = -1, buffers: Mapping[str, Array] | None = None,
        wait_timeout_s: float = 0.0, rows: Mapping[str, IndexArray] | None = None,
    ) -> ShardValues:
        """See DataPath.pull."""
        return self.data.pull(worker_id, if_newer_than, buffers, wait_timeout_s, rows)

    def push(self, request: PushRequest) -> PushOutcome:
        """See DataPath.push."""
        return self.data.push(request)

    def push_pull(
        self, request: PushRequest, pull_if_newer_than: int = -1, buffers: Mapping[str, Array] | None = None,
        read_wait_s: float = 0.0, rows: Mapping[str, IndexArray] | None = None,
    ) -> tuple[PushOutcome, ShardValues]:
        """See DataPath.push_pull."""
        return self.data.push_pull(request, pull_if_newer_than, buffers, read_wait_s, rows)

    # the control face: the chief's calls
    def initialize(
        self, worker_id: str, shard_index: int, num_shards: int, rule: UpdateRuleConfig,
        values: Mapping[str, Array], run_id: str = "", generated: Mapping[str, TableSpec] | None = None,
        incarnation: int = 0,
    ) -> InitResult:
        """See ShardControl.initialize."""
        return self.control.initialize(worker_id, shard_index, num_shards, rule, values, run_id, generated,
                                       incarnation)

    def stats(self, deadline_s: float | None = None) -> StoreStats:
        """See ShardControl.stats."""
        return self.control.stats(deadline_s)

    def pause(self, hold_s: float) -> int:
        """See ShardControl.pause."""
        return self.control.pause(hold_s)

    def hold(self, hold_s: float, decisions_since: int = -1, sync: Decisions | None = None) -> Held:
        """See ShardControl.hold."""
        return self.control.hold(hold_s, decisions_since, sync)

    def snapshot(self) -> Snapshot:
        """See ShardControl.snapshot."""
        return self.control.snapshot()

    def restore(self, snap: Snapshot, shard_index: int) -> InitResult:
        """See ShardControl.restore."""
        return self.control.restore(snap, shard_index)

    def snapshot_stream(self) -> SnapshotStream:
        """See ShardControl.snapshot_stream."""
        return self.control.snapshot_stream()

    def restore_stream(self, snap: Snapshot, shard_index: int,
                       slices: Callable[[], Iterable[Slice]]) -> InitResult:
        """See ShardControl.restore_stream."""
        return self.control.restore_stream(snap, shard_index, slices)

    def set_live_workers(self, worker_ids: Sequence[str]) -> None:
        """See ShardControl.set_live_workers."""
        self.control.set_live_workers(worker_ids)

    def shutdown(self, reason: str, deadline_s: float = 5.0) -> None:
        """See ShardControl.shutdown."""
        self.control.shutdown(reason, deadline_s)

    def close(self) -> None:
        """Close the data path, then the control face (and with it the shared channel)."""
        try:
            self.data.close()
        finally:
            self.control.close()


__all__ = ["ClientSetup", "DataPath", "InitResult", "ModelBuffers", "PushRequest", "ShardClient", "ShardControl",
           "ShardTransport", "SnapshotStream"]
