"""The gRPC transport to one shard: raw frames for tensor streams, protobuf for control calls,
deadlines, and retries of transient failures only. Protobuf does not leave this module.

`ShardLink` is the channel and its retry policy; `GrpcShardControl` is the control face over it and
`FramesDataPath` the reference data path ("grpc" in asyncps.transport.registry)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from asyncps.errors import InvalidArgumentError
from asyncps.net.rpc import raising_domain_errors
from asyncps.net.security import SecurityConfig
from asyncps.pb import ps_pb2, tensor_pb2
from asyncps.rules import UpdateRuleConfig
from asyncps.rules.initializers import TableSpec
from asyncps.rules.sync.types import Decisions, Held
from asyncps.transport.base import ClientSetup, DataPath, InitResult, ShardClient, SnapshotStream
from asyncps.transport.link import ShardLink
from asyncps.wire.codec import DEFAULT_CHUNK_BYTES, Array, IndexArray, SparseRows, TensorAssembler
from asyncps.wire.frames import Slice, decode_frame, frames, identity, read_frames
from asyncps.wire.proto import (
    decisions_from_proto,
    decisions_to_proto,
    generated_to_proto,
    initialize_frames,
    outcome_from_proto,
    parse_pull,
    parse_snapshot,
    push_frames,
    push_header,
    row_ids_to_proto,
    rule_to_proto,
    snapshot_frames,
    snapshot_from_wire,
    snapshot_header,
    stats_from_proto,
)
from asyncps.wire.shard import PushOutcome, PushRequest, ShardValues, Snapshot, StoreStats


def _read_values(
    stream: Iterable[bytes], buffers: Mapping[str, Array] | None, what: str,
    rows: Mapping[str, IndexArray] | None = None,
) -> tuple[ps_pb2.PullHeader, ShardValues]:
    """A pull reply: its header, the values, received into `buffers` where they fit, and the rows asked."""
    assembler = TensorAssembler(buffers=buffers)
    header: ps_pb2.PullHeader = read_frames(stream, parse_pull, assembler, what)
    return header, shard_values(header, *assembler.finish_reply(rows or {}), asked=rows)


def shard_values(header: ps_pb2.PullHeader, values: dict[str, Array], served: dict[str, SparseRows],
                 asked: Mapping[str, IndexArray] | None) -> ShardValues:
    """A pull reply's header, values and rows served as ShardValues (rows: None when none were asked);
    values where the header says not modified are InvalidArgumentError."""
    if header.not_modified and values:
        raise InvalidArgumentError(f"the shard sent values {sorted(values)} in a reply it says is not modified")
    decisions = decisions_from_proto(header.sync) if header.HasField("sync") else None
    return ShardValues(header.version, header.incarnation, None if header.not_modified else values,
                       header.waited_s, decisions, rows=served if asked else None)


def received_values(header: ps_pb2.PullHeader, chunks: Sequence[tensor_pb2.TensorChunk], arrays: Sequence[Array],
                    asked: Mapping[str, IndexArray] | None) -> ShardValues:
    """A reply read off a framed data connection (its tensors received whole, in the order of `chunks`)
    as ShardValues, its rows checked against those asked."""
    assembler = TensorAssembler()
    for chunk, array in zip(chunks, arrays, strict=True):
        assembler.put(chunk, array)
    return shard_values(header, *assembler.finish_reply(asked or {}), asked=asked)


class FramesDataPath:
    """The reference data path: tensors as raw frames over the link's gRPC streams."""

    def __init__(self, link: ShardLink, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.address = link.address
        self._link = link
        self._chunk_bytes = chunk_bytes
        ch = link.channel
        self._pull = ch.unary_stream(link.path("Pull"), request_serializer=ps_pb2.PullRequest.SerializeToString,
                                     response_deserializer=identity)
        self._push = ch.stream_unary(link.path("Push"), request_serializer=identity,
                                     response_deserializer=ps_pb2.PushResult.FromString)
        self._push_pull = ch.stream_stream(link.path("PushPull"), request_serializer=identity,
                                           response_deserializer=identity)

    def pull(
        self, worker_id: str, if_newer_than: int = -1, buffers: Mapping[str, Array] | None = None,
        wait_timeout_s: float = 0.0, rows: Mapping[str, IndexArray] | None = None,
    ) -> ShardValues:
        """The shard's values (into `buffers` where they fit), or None when not newer; the parts in
        `rows` as those rows only."""
        request = ps_pb2.PullRequest(worker_id=worker_id, if_newer_than=if_newer_than,
                                     wait_timeout_s=wait_timeout_s, rows=row_ids_to_proto(rows))

        def call() -> ShardValues:
            stream = self._pull(request, timeout=self._link.call_timeout_s + wait_timeout_s)
            return _read_values(stream, buffers, "pull reply", rows)[1]

        return self._link.retry(call, training=True)

    def push(self, request: PushRequest) -> PushOutcome:
        """Apply or drop one gradient."""
        header = push_header(request)
        return outcome_from_proto(self._link.retry(
            lambda: self._push(push_frames(header, request.grads, self._chunk_bytes),
                               timeout=self._link.call_timeout_s)))

    def push_pull(
        self, request: PushRequest, pull_if_newer_than: int = -1, buffers: Mapping[str, Array] | None = None,
        read_wait_s: float = 0.0, rows: Mapping[str, IndexArray] | None = None,
    ) -> tuple[PushOutcome, ShardValues]:
        """Push, then receive the values in one round trip (held up to read_wait_s by sync/ssp); the
        parts in `rows` as those rows only."""
        header = push_header(request, pull_if_newer_than, read_wait_s)

        def call() -> tuple[PushOutcome, ShardValues]:
            stream = self._push_pull(push_frames(header, request.grads, self._chunk_bytes, rows),
                                     timeout=self._link.call_timeout_s + read_wait_s)
            reply_header, values = _read_values(stream, buffers, "push-pull reply", rows)
            return outcome_from_proto(reply_header.push), values

        return self._link.retry(call, training=True)

    def close(self) -> None:
        """Nothing of its own: the channel is the link's (closed by the control face)."""


def frames_data_path(setup: ClientSetup, fallback: DataPath | None, required: bool) -> DataPath:
    """The registry's factory for "grpc": frames over the shard's gRPC link (needs no fallback)."""
    return FramesDataPath(setup.link, setup.chunk_bytes)


class GrpcShardControl:
    """The control face of one shard over its gRPC link: protobuf calls, frames for whole states."""

    def __init__(self, link: ShardLink, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.address = link.address
        self.link = link
        self._chunk_bytes = chunk_bytes
        ch = link.channel
        path = link.path
        self._initialize = ch.stream_unary(path("Initialize"), request_serializer=identity,
                                           response_deserializer=ps_pb2.InitializeResponse.FromString)
        self._snapshot = ch.unary_stream(path("Snapshot"), request_serializer=ps_pb2.SnapshotRequest.SerializeToString,
                                         response_deserializer=identity)
        self._restore = ch.stream_unary(path("Restore"), request_serializer=identity,
                                        response_deserializer=ps_pb2.InitializeResponse.FromString)
        self._stats = ch.unary_unary(path("GetStats"), request_serializer=ps_pb2.StatsRequest.SerializeToString,
                                     response_deserializer=ps_pb2.ShardStats.FromString)
        self._pause = ch.unary_unary(path("Pause"), request_serializer=ps_pb2.PauseRequest.SerializeToString,
                                     response_deserializer=ps_pb2.PauseResponse.FromString)
        self._live = ch.unary_unary(path("SetLiveWorkers"),
                                    request_serializer=ps_pb2.LiveWorkersRequest.SerializeToString,
                                    response_deserializer=ps_pb2.LiveWorkersResponse.FromString)
        self._shutdown = ch.unary_unary(path("Shutdown"), request_serializer=ps_pb2.ShutdownRequest.SerializeToString,
                                        response_deserializer=ps_pb2.ShutdownResponse.FromString)
        self._set_backup = ch.unary_unary(path("SetBackup"),
                                          request_serializer=ps_pb2.SetBackupRequest.SerializeToString,
                                          response_deserializer=ps_pb2.SetBackupResponse.FromString)
        self._promote = ch.unary_unary(path("Promote"), request_serializer=ps_pb2.PromoteRequest.SerializeToString,
                                       response_deserializer=ps_pb2.PromoteResponse.FromString)

    def initialize(
        self, worker_id: str, shard_index: int, num_shards: int, rule: UpdateRuleConfig,
        values: Mapping[str, Array], run_id: str = "", generated: Mapping[str, TableSpec] | None = None,
        incarnation: int = 0,
    ) -> InitResult:
        """Send initial values and the update rule (idempotent on the shard for the same run); the parts
        in `generated` the shard makes itself (only their specs travel); `incarnation`: the one the state
        takes (0: the shard draws one)."""
        header = ps_pb2.InitializeHeader(worker_id=worker_id, shard_index=shard_index, num_shards=num_shards,
                                         rule=rule_to_proto(rule), run_id=run_id,
                                         generated=generated_to_proto(generated), incarnation=incarnation)
        reply = self.link.retry(lambda: self._initialize(initialize_frames(header, values, self._chunk_bytes),
                                                     timeout=self.link.call_timeout_s))
        return InitResult(reply.created, reply.version)

    def stats(self, deadline_s: float | None = None) -> StoreStats:
        """The shard's counters and variable metadata."""
        return stats_from_proto(self.link.retry(
            lambda: self._stats(ps_pb2.StatsRequest(), timeout=self.link.call_timeout_s), deadline_s))

    def pause(self, hold_s: float) -> int:
        """Hold pushes for up to hold_s seconds (0: release); returns the shard's version."""
        request = ps_pb2.PauseRequest(pause=hold_s > 0, max_hold_s=hold_s)
        return int(self.link.retry(lambda: self._pause(request, timeout=self.link.call_timeout_s)).version)

    def hold(self, hold_s: float, decisions_since: int = -1, sync: Decisions | None = None) -> Held:
        """A pause that also reads the coordinator's decisions or commits them on a follower."""
        request = ps_pb2.PauseRequest(pause=hold_s > 0, max_hold_s=hold_s, decisions_since=decisions_since)
        if sync is not None:
            request.sync.CopyFrom(decisions_to_proto(sync))
        reply = self.link.retry(lambda: self._pause(request, timeout=self.link.call_timeout_s))
        decided = decisions_from_proto(reply.decided) if reply.HasField("decided") else None
        return Held(int(reply.version), reply.sync_follower, int(reply.sync_lineage), int(reply.sync_next_step),
                    decided)

    def snapshot(self) -> Snapshot:
        """The shard's whole state (values, slots, counters)."""
        def call() -> Snapshot:
            assembler = TensorAssembler()
            stream = self._snapshot(ps_pb2.SnapshotRequest(), timeout=self.link.call_timeout_s * 4)
            header = read_frames(stream, parse_snapshot, assembler, "snapshot")
            return snapshot_from_wire(header, assembler.finish())

        return self.link.retry(call)

    def restore(self, snap: Snapshot, shard_index: int) -> InitResult:
        """Replace the shard's state with a checkpoint's part."""
        header = snapshot_header(snap, shard_index)
        reply = self.link.retry(lambda: self._restore(snapshot_frames(header, snap, self._chunk_bytes),
                                                  timeout=self.link.call_timeout_s * 4))
        return InitResult(reply.created, reply.version)

    def snapshot_stream(self) -> SnapshotStream:
        """See ShardControl.snapshot_stream: the call is retried until its first frame (the header) came."""
        def first() -> tuple[Any, bytes]:
            stream: Any = self._snapshot(ps_pb2.SnapshotRequest(), timeout=self.link.call_timeout_s * 4)
            return stream, next(stream)

        stream, frame = self.link.retry(first)
        message, data = decode_frame(frame, parse_snapshot, "snapshot")
        if not message.HasField("header"):
            stream.cancel()
            raise InvalidArgumentError("snapshot: the first frame has no header")
        header = snapshot_from_wire(message.header, {})
        return SnapshotStream(header, _snapshot_slices(stream, message, data), stream.cancel)

    def restore_stream(self, snap: Snapshot, shard_index: int,
                       slices: Callable[[], Iterable[Slice]]) -> InitResult:
        """See ShardControl.restore_stream (a retry reads the slices again)."""
        header = snapshot_header(snap, shard_index)

        def make(h: Any, chunks: list[tensor_pb2.TensorChunk]) -> ps_pb2.SnapshotChunk:
            return ps_pb2.SnapshotChunk(header=h, tensors=chunks)

        reply = self.link.retry(lambda: self._restore(frames(make, header, slices(), self._chunk_bytes),
                                                      timeout=self.link.call_timeout_s * 4))
        return InitResult(reply.created, reply.version)

    def set_live_workers(self, worker_ids: Sequence[str]) -> None:
        """Tell the shard which workers are alive."""
        request = ps_pb2.LiveWorkersRequest(worker_ids=worker_ids)
        self.link.retry(lambda: self._live(request, timeout=self.link.call_timeout_s))

    def shutdown(self, reason: str, deadline_s: float = 5.0) -> None:
        """Ask the shard process to exit."""
        self.link.retry(lambda: self._shutdown(ps_pb2.ShutdownRequest(reason=reason), timeout=deadline_s), deadline_s)

    def set_backup(self, address: str) -> int:
        """Replicated shards: forward every state change to the backup at `address` ("": none); the version."""
        request = ps_pb2.SetBackupRequest(address=address)
        return int(self.link.retry(lambda: self._set_backup(request, timeout=self.link.call_timeout_s)).version)

    def promote(self, port: int) -> int:
        """Replicated shards: this backup takes over its dead primary's `port`; where it serves now."""
        request = ps_pb2.PromoteRequest(port=port)
        return int(self.link.retry(lambda: self._promote(request, timeout=self.link.call_timeout_s)).port)

    def close(self) -> None:
        """Close the link's channel (every data path over it stops too)."""
        self.link.close()


def _snapshot_slices(stream: Any, message: Any, data: list[memoryview]) -> Iterator[Slice]:
    """The tensors' slices of a snapshot stream whose first frame (`message`, `data`) was read; the
    stream's failures raised as asyncps.errors."""
    read = raising_domain_errors(lambda: next(stream, None))
    try:
        while True:
            for chunk, view in zip(message.tensors, data, strict=True):
                if chunk.role != tensor_pb2.DENSE:
                    raise InvalidArgumentError(f"snapshot tensor {chunk.name}: not dense")
                yield Slice(chunk.name, chunk.role, chunk.dtype, tuple(int(d) for d in chunk.shape), chunk.offset, view)
            frame = read()
            if frame is None:
                return
            message, data = decode_frame(frame, parse_snapshot, "snapshot")
            if message.HasField("header"):
                raise InvalidArgumentError("snapshot: a header after the first frame")
    finally:
        stream.cancel()  # a no-op once the stream ended


class GrpcShardTransport(ShardClient):
    """Both faces to one shard over gRPC alone (control calls and frames): the reference client."""

    def __init__(
        self,
        address: str,
        deadline_s: float = 60.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        security: SecurityConfig | None = None,
        call_timeout_s: float = 30.0,
        seed: int | None = None,
    ) -> None:
        link = ShardLink(address, deadline_s, security, call_timeout_s, seed)
        super().__init__(GrpcShardControl(link, chunk_bytes), FramesDataPath(link, chunk_bytes))


__all__ = ["FramesDataPath", "GrpcShardControl", "GrpcShardTransport", "ShardLink", "frames_data_path",
           "received_values", "shard_values"]
