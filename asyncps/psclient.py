"""Clients of the parameter-server shards: one shard (ShardClient) and a whole model (ModelClient)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import grpc
import numpy as np

from asyncps.codec import (
    DEFAULT_CHUNK_BYTES,
    Array,
    Gradient,
    SparseRows,
    TensorAssembler,
    framed,
    gradient_chunks,
    iter_chunks,
    read_frames,
)
from asyncps.errors import InvalidArgumentError
from asyncps.pb import ps_pb2, ps_pb2_grpc
from asyncps.placement import Placement
from asyncps.rpc import call_with_retry, make_channel
from asyncps.security import SecurityConfig, secure_channel
from asyncps.shard import Snapshot
from asyncps.wire import snapshot_frames, snapshot_from_wire, snapshot_header

T = TypeVar("T")


@dataclass(frozen=True)
class PullReply:
    """Values of a shard (None when not newer than asked) and the version they are at."""

    version: int
    values: dict[str, Array] | None
    waited_s: float = 0.0  # time the shard held the reply back (sync/ssp)
    incarnation: int = 0


def _assemble(
    stream: Iterable[ps_pb2.PullChunk], buffers: Mapping[str, Array] | None
) -> tuple[ps_pb2.PullHeader, dict[str, Array] | None]:
    assembler = TensorAssembler(buffers=buffers)
    header = read_frames(stream, assembler, "pull reply")
    if header.not_modified:
        return header, None
    values: dict[str, Array] = {}
    for name, value in assembler.finish().items():
        if isinstance(value, SparseRows):
            raise InvalidArgumentError(f"{name}: shard sent sparse values")
        values[name] = value
    return header, values


_RETRY = (grpc.StatusCode.UNAVAILABLE,)
_TRAINING_RETRY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION)


class ShardClient:
    """Typed calls to one shard, with deadlines and retries of UNAVAILABLE only."""

    def __init__(
        self,
        address: str,
        deadline_s: float = 60.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        security: SecurityConfig | None = None,
        call_timeout_s: float = 30.0,
        seed: int | None = None,
    ) -> None:
        self.address = address
        self._deadline_s = deadline_s
        self._call_timeout_s = call_timeout_s
        self._chunk_bytes = chunk_bytes
        self._channel = secure_channel(address, security) if security else make_channel(address)
        self._stub = ps_pb2_grpc.ParameterServerStub(self._channel)
        self._rng = random.Random(seed)

    def _retry(self, fn: Callable[[], T], deadline_s: float | None = None, training: bool = False) -> T:
        # Training calls also ride through a shard that restarted and waits for the chief to
        # restore it (FAILED_PRECONDITION: not initialized).
        codes = _TRAINING_RETRY if training else _RETRY
        return call_with_retry(fn, f"parameter server {self.address}",
                               self._deadline_s if deadline_s is None else deadline_s, retry_codes=codes,
                               rng=self._rng)

    def initialize(
        self, member_id: str, shard_index: int, num_shards: int, rule: ps_pb2.UpdateRule,
        values: Mapping[str, Array],
    ) -> ps_pb2.InitializeResponse:
        """Send initial values and the update rule (idempotent on the shard)."""
        def stream() -> Iterator[ps_pb2.InitializeChunk]:
            header = ps_pb2.InitializeHeader(
                worker_id=member_id, shard_index=shard_index, num_shards=num_shards, rule=rule)
            chunks = (c for name, value in values.items()
                      for c in iter_chunks(name, value, chunk_bytes=self._chunk_bytes))
            # a shard that placement left empty still gets a header-only frame with its rule
            yield from framed(lambda h, frame: ps_pb2.InitializeChunk(header=h, tensors=frame), header, chunks,
                              self._chunk_bytes)

        return self._retry(lambda: self._stub.Initialize(stream(), timeout=self._call_timeout_s))

    def pull(
        self, member_id: str, if_newer_than: int = -1, buffers: Mapping[str, Array] | None = None,
        wait_timeout_s: float = 0.0,
    ) -> PullReply:
        """Fetch the shard's values (into `buffers` where they fit)."""
        request = ps_pb2.PullRequest(worker_id=member_id, if_newer_than=if_newer_than,
                                     wait_timeout_s=wait_timeout_s)

        def call() -> PullReply:
            header, values = _assemble(
                self._stub.Pull(request, timeout=self._call_timeout_s + wait_timeout_s), buffers)
            return PullReply(header.version, values, 0.0, header.incarnation)

        return self._retry(call, training=True)

    def _push_stream(self, header: ps_pb2.PushHeader, grads: Mapping[str, Gradient]) -> Iterator[ps_pb2.PushChunk]:
        chunks = (c for name, grad in grads.items() for c in gradient_chunks(name, grad, self._chunk_bytes))
        return framed(lambda h, frame: ps_pb2.PushChunk(header=h, tensors=frame), header, chunks, self._chunk_bytes)

    def push(
        self, member_id: str, base_version: int, grads: Mapping[str, Gradient], step: int = 0,
        loss: float = 0.0,
    ) -> ps_pb2.PushResult:
        """Push one gradient computed from base_version."""
        header = ps_pb2.PushHeader(worker_id=member_id, base_version=base_version, step=step, loss=loss)
        return self._retry(lambda: self._stub.Push(self._push_stream(header, grads), timeout=self._call_timeout_s))

    def push_pull(
        self, member_id: str, base_version: int, grads: Mapping[str, Gradient], step: int = 0,
        loss: float = 0.0, pull_if_newer_than: int = -1, buffers: Mapping[str, Array] | None = None,
        read_wait_s: float = 0.0, incarnation: int = 0,
    ) -> tuple[ps_pb2.PushResult, PullReply]:
        """Push, then receive the values, in one round trip (held up to read_wait_s by sync/ssp)."""
        header = ps_pb2.PushHeader(worker_id=member_id, base_version=base_version, step=step,
                                   loss=loss, pull_if_newer_than=pull_if_newer_than, read_wait_s=read_wait_s,
                                   incarnation=incarnation)

        def call() -> tuple[ps_pb2.PushResult, PullReply]:
            reply_header, values = _assemble(
                self._stub.PushPull(self._push_stream(header, grads), timeout=self._call_timeout_s + read_wait_s),
                buffers)
            return reply_header.push, PullReply(reply_header.version, values, reply_header.waited_s,
                                                reply_header.incarnation)

        return self._retry(call, training=True)

    def stats(self, deadline_s: float | None = None) -> ps_pb2.ShardStats:
        """The shard's counters."""
        return self._retry(lambda: self._stub.GetStats(ps_pb2.StatsRequest(), timeout=self._call_timeout_s),
                           deadline_s)

    def pause(self, hold_s: float) -> int:
        """Hold pushes for up to hold_s seconds (0: release); returns the shard's version."""
        request = ps_pb2.PauseRequest(pause=hold_s > 0, max_hold_s=hold_s)
        return self._retry(lambda: self._stub.Pause(request, timeout=self._call_timeout_s)).version

    def snapshot(self) -> Snapshot:
        """The shard's whole state (values, slots, counters)."""
        def call() -> Snapshot:
            assembler = TensorAssembler()
            stream = self._stub.Snapshot(ps_pb2.SnapshotRequest(), timeout=self._call_timeout_s * 4)
            return snapshot_from_wire(read_frames(stream, assembler, "snapshot"), assembler.finish())

        return self._retry(call)

    def restore(self, snap: Snapshot, shard_index: int) -> ps_pb2.InitializeResponse:
        """Replace the shard's state with a checkpoint's part."""
        header = snapshot_header(snap, shard_index)
        return self._retry(lambda: self._stub.Restore(snapshot_frames(header, snap, self._chunk_bytes),
                                                      timeout=self._call_timeout_s * 4))

    def set_live_workers(self, worker_ids: Sequence[str]) -> None:
        """Tell the shard which workers are alive."""
        request = ps_pb2.LiveWorkersRequest(worker_ids=worker_ids)
        self._retry(lambda: self._stub.SetLiveWorkers(request, timeout=self._call_timeout_s))

    def shutdown(self, reason: str, deadline_s: float = 5.0) -> None:
        """Ask the shard process to exit."""
        self._retry(lambda: self._stub.Shutdown(ps_pb2.ShutdownRequest(reason=reason), timeout=deadline_s),
                    deadline_s)

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()


@dataclass(frozen=True)
class ShardPush:
    """The result of pushing one step's gradient to one shard."""

    shard: int
    result: ps_pb2.PushResult
    version: int
    waited_s: float = 0.0


class ModelClient:
    """The whole model over all shards: pulls into full-size buffers, splits and pushes gradients.

    Received parts are written straight into views of the full variable buffers (an axis-0 slice
    of a C-contiguous array is contiguous), so reassembling a sliced variable costs no copy.
    """

    def __init__(
        self,
        member_id: str,
        addresses: Sequence[str],
        placement: Placement,
        deadline_s: float = 60.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        security: SecurityConfig | None = None,
    ) -> None:
        if len(addresses) != placement.num_shards:
            raise ValueError(f"{len(addresses)} shard addresses for a placement over {placement.num_shards}")
        self.member_id = member_id
        self.placement = placement
        self.shards = [ShardClient(a, deadline_s, chunk_bytes, security) for a in addresses]
        self.values: dict[str, Array] = {
            v.name: np.zeros(v.shape, dtype=v.dtype) for v in placement.variables
        }
        self.versions = [-1] * placement.num_shards
        self.incarnations = [0] * placement.num_shards
        self._views: list[dict[str, Array]] = [{} for _ in addresses]
        for part in placement.parts:
            full = self.values[part.variable]
            self._views[part.shard][part.name] = full[part.rows()] if part.sliced else full
        self._pool = ThreadPoolExecutor(max_workers=len(addresses), thread_name_prefix="shard")

    def _on_all(self, fn: Callable[[int], T]) -> list[T]:
        if len(self.shards) == 1:
            return [fn(0)]
        return list(self._pool.map(fn, range(len(self.shards))))

    def _accept(self, shard: int, reply: PullReply) -> None:
        self.versions[shard] = reply.version
        self.incarnations[shard] = reply.incarnation
        if reply.values is None:
            return
        views = self._views[shard]
        if set(reply.values) != set(views):
            raise InvalidArgumentError(
                f"shard {shard} holds {sorted(reply.values)}, placement expects {sorted(views)}")
        for name, value in reply.values.items():
            if value is not views[name]:  # not received in place: shapes differ or a first pull
                np.copyto(views[name], value)

    def pull(self, only_if_newer: bool = False) -> list[int]:
        """Refresh every variable from every shard; return the version vector."""
        def one(shard: int) -> None:
            since = self.versions[shard] if only_if_newer else -1
            self._accept(shard, self.shards[shard].pull(self.member_id, since, self._views[shard]))

        self._on_all(one)
        return list(self.versions)

    def split(self, grads: Mapping[str, Gradient]) -> list[dict[str, Gradient]]:
        """Cut full-variable gradients into per-shard dicts of parts."""
        per_shard: list[dict[str, Gradient]] = [{} for _ in self.shards]
        for part in self.placement.parts:
            grad = grads.get(part.variable)
            if grad is None:
                continue
            if not part.sliced:
                per_shard[part.shard][part.name] = grad
            elif isinstance(grad, SparseRows):
                mask = (grad.indices >= part.row_start) & (grad.indices < part.row_stop)
                if mask.any():
                    per_shard[part.shard][part.name] = SparseRows(
                        grad.indices[mask] - part.row_start, grad.values[mask])
            else:
                per_shard[part.shard][part.name] = grad[part.rows()]
        return per_shard

    def push_pull(
        self, grads: Mapping[str, Gradient], step: int, loss: float, read_wait_s: float = 0.0
    ) -> list[ShardPush]:
        """Push one step's gradient to every shard with the versions it was computed from, and
        receive the new values in the same round trip."""
        per_shard = self.split(grads)
        base = list(self.versions)

        def one(shard: int) -> ShardPush:
            if not per_shard[shard]:  # nothing of this shard was touched (sparse-only models)
                reply = self.shards[shard].pull(self.member_id, base[shard], self._views[shard])
                self._accept(shard, reply)
                return ShardPush(shard, ps_pb2.PushResult(accepted=False, drop_reason="empty"), reply.version)
            result, reply = self.shards[shard].push_pull(
                self.member_id, base[shard], per_shard[shard], step, loss, -1, self._views[shard], read_wait_s,
                self.incarnations[shard])
            self._accept(shard, reply)
            return ShardPush(shard, result, reply.version, reply.waited_s)

        return self._on_all(one)

    def close(self) -> None:
        """Close every channel and the thread pool."""
        self._pool.shutdown(wait=False)
        for shard in self.shards:
            shard.close()
