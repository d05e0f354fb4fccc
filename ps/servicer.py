"""The gRPC adapter of a shard: the control face and the "grpc" data path (frames) over the
ShardService. Frames and protobuf <-> the service's domain calls, domain errors -> status codes.
Tensor streams travel as raw frames (asyncps.wire.frames); control calls are plain protobuf."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grpc
from asyncps.ps.adapter import DEFAULT_MAX_REQUEST_BYTES, ShardSide, reply_header, wait_limit
from asyncps.ps.service import ShardService

from asyncps.errors import FailedPreconditionError, InvalidArgumentError
from asyncps.net.handlers import Handler
from asyncps.net.rpc import handles_errors
from asyncps.pb import ps_pb2
from asyncps.rules.registry import plugin_modules_only
from asyncps.wire.codec import DEFAULT_CHUNK_BYTES, Array, IndexArray, SparseRows, TensorAssembler, rows_nbytes
from asyncps.wire.frames import identity, read_frames
from asyncps.wire.proto import (
    decisions_from_proto,
    decisions_to_proto,
    generated_from_proto,
    outcome_to_proto,
    parse_initialize,
    parse_push,
    parse_snapshot,
    pull_header_frame,
    push_request,
    row_frames,
    row_ids_from_proto,
    rule_from_proto,
    snapshot_frames,
    snapshot_from_wire,
    snapshot_header,
    stats_to_proto,
    value_frames,
)
from asyncps.wire.shard import PushRequest, ShardValues

log = logging.getLogger(__name__)

# The server has more handler threads than the service lets wait at once (DEFAULT_MAX_WAITERS).
SHARD_HANDLER_THREADS = 256


class _ReplyCache:
    """The encoded value frames of the latest version read: every reader of one version shares
    them, and they are built from the store's read-only arrays with no lock of the store held."""

    def __init__(self, chunk_bytes: int) -> None:
        self._chunk_bytes = chunk_bytes
        self._lock = threading.Lock()
        self._key: tuple[int, int, tuple[str, ...]] | None = None
        self._frames: list[bytes] = []
        self._nbytes = 0

    def frames(self, incarnation: int, version: int, values: Mapping[str, Array]) -> tuple[list[bytes], int]:
        """The frames of these values and their tensor bytes (encoded once per version and set of parts:
        a reply without the parts its reader reads by rows holds fewer)."""
        key = (incarnation, version, tuple(values))
        with self._lock:
            if self._key != key:
                self._frames = value_frames(values, self._chunk_bytes)
                self._nbytes = sum(v.nbytes for v in values.values())
                self._key = key
            return self._frames, self._nbytes


class ParameterServerServicer:
    """Serves one shard's control calls and framed tensors over gRPC (a ShardAdapter)."""

    def __init__(
        self,
        service: ShardService,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        on_shutdown: Callable[[str], None] | None = None,
        plugin_modules: frozenset[str] = frozenset(),
        on_set_backup: Callable[[str], int] | None = None,
        on_promote: Callable[[int], int] | None = None,
    ) -> None:
        self._service = service
        # a request's rule spec imports plugin modules only from these (asyncps.rules.registry)
        self._plugin_modules = plugin_modules
        self._chunk_bytes = chunk_bytes
        self._max_request_bytes = max_request_bytes
        self._on_shutdown = on_shutdown
        self._on_set_backup, self._on_promote = on_set_backup, on_promote
        self._cache = _ReplyCache(chunk_bytes)

    @handles_errors
    def Initialize(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> ps_pb2.InitializeResponse:
        """Create the shard's variables and update rule (idempotent)."""
        assembler = TensorAssembler(self._max_request_bytes)
        header = read_frames(request_iterator, parse_initialize, assembler, "Initialize")
        with plugin_modules_only(self._plugin_modules):
            rule = rule_from_proto(header.rule)
        values: dict[str, Array] = {}
        for name, value in assembler.finish().items():
            if isinstance(value, SparseRows):
                raise InvalidArgumentError(f"{name}: initial values must be dense")
            values[name] = value
        generated = generated_from_proto(header.generated)
        created, version = self._service.initialize(rule, values, header.run_id, generated, header.incarnation)
        log.info("Initialize from %s: %s (%d variables, %d made here)", header.worker_id,
                 "created" if created else "identical, accepted", len(values) + len(generated), len(generated))
        return ps_pb2.InitializeResponse(created=created, version=version)

    def _reply(self, reply: ShardValues, push: ps_pb2.PushResult | None = None) -> Iterator[bytes]:
        """The header, the values (cached per version) and the rows read (encoded for this reply)."""
        yield pull_header_frame(reply_header(reply, push, self._service.shard_index))
        nbytes = 0
        if reply.values is not None:
            frames, nbytes = self._cache.frames(reply.incarnation, reply.version, reply.values)
            yield from frames
        if reply.rows:
            yield from row_frames(reply.rows, self._chunk_bytes)
            nbytes += rows_nbytes(reply.rows)
        self._service.count("grpc", pulled=nbytes)

    @handles_errors
    def Pull(self, request: ps_pb2.PullRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        """Stream the values (optionally after a long-poll for a newer version), the parts asked by rows
        as those rows."""
        rows = row_ids_from_proto(request.rows, self._max_request_bytes)
        self._service.count("grpc", pushed=sum(ids.nbytes for ids in rows.values()))
        limit = wait_limit("wait_timeout_s", request.wait_timeout_s, context)
        yield from self._reply(self._service.pull(request.worker_id, request.if_newer_than, limit, rows))

    def _read_push(
        self, request_iterator: Iterator[bytes], what: str
    ) -> tuple[ps_pb2.PushHeader, PushRequest, dict[str, IndexArray]]:
        """A push's header, its request and the row ids it reads (a push-pull's)."""
        assembler = TensorAssembler(self._max_request_bytes)
        header: ps_pb2.PushHeader = read_frames(request_iterator, parse_push, assembler, what)
        grads, rows = assembler.finish_request()
        self._service.count("grpc", pushed=assembler.total_bytes)
        return header, push_request(header, grads), rows

    @handles_errors
    def Push(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> ps_pb2.PushResult:
        """Apply or drop one gradient."""
        _, request, rows = self._read_push(request_iterator, "Push")
        if rows:
            raise InvalidArgumentError(f"{sorted(rows)}: a push reads no rows (a push-pull does)")
        return outcome_to_proto(self._service.push(request))

    @handles_errors
    def PushPull(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        """Push, then stream the values back in the same call (the parts asked by rows as those rows)."""
        header, request, rows = self._read_push(request_iterator, "PushPull")
        # the whole request is validated before the store changes
        limit = wait_limit("read_wait_s", header.read_wait_s, context, margin_s=1.0)
        outcome, reply = self._service.push_pull(request, header.pull_if_newer_than, limit, rows)
        yield from self._reply(reply, outcome_to_proto(outcome))

    @handles_errors
    def GetStats(self, request: ps_pb2.StatsRequest, context: grpc.ServicerContext) -> ps_pb2.ShardStats:
        """Counters and variable metadata."""
        return stats_to_proto(self._service.stats())

    @handles_errors
    def SetLiveWorkers(
        self, request: ps_pb2.LiveWorkersRequest, context: grpc.ServicerContext
    ) -> ps_pb2.LiveWorkersResponse:
        """Update the live set used by the consistency model."""
        return ps_pb2.LiveWorkersResponse(version=self._service.set_live_workers(list(request.worker_ids)))

    @handles_errors
    def Pause(self, request: ps_pb2.PauseRequest, context: grpc.ServicerContext) -> ps_pb2.PauseResponse:
        """Hold or release pushes (a checkpoint cut)."""
        if request.pause and not 0 < request.max_hold_s <= 600:
            raise InvalidArgumentError("a pause needs max_hold_s in (0, 600] seconds")
        sync = decisions_from_proto(request.sync) if request.HasField("sync") else None
        held = self._service.hold(request.max_hold_s if request.pause else 0.0, request.decisions_since, sync)
        reply = ps_pb2.PauseResponse(version=held.version, sync_follower=held.follower,
                                     sync_lineage=held.lineage, sync_next_step=held.next_step)
        if held.decided is not None:
            reply.decided.CopyFrom(decisions_to_proto(held.decided))
        return reply

    @handles_errors
    def Snapshot(self, request: ps_pb2.SnapshotRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        """Stream the whole state for a checkpoint."""
        snap = self._service.snapshot()
        yield from snapshot_frames(snapshot_header(snap, self._service.shard_index), snap, self._chunk_bytes)

    @handles_errors
    def Restore(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> ps_pb2.InitializeResponse:
        """Replace the state with a checkpoint's part."""
        assembler = TensorAssembler(self._max_request_bytes)
        header = read_frames(request_iterator, parse_snapshot, assembler, "Restore")
        with plugin_modules_only(self._plugin_modules):
            snap = snapshot_from_wire(header, assembler.finish())
        version = self._service.restore(snap)
        log.info("restored %d variables at version %d", len(snap.values), version)
        return ps_pb2.InitializeResponse(created=True, version=version)

    @handles_errors
    def Shutdown(self, request: ps_pb2.ShutdownRequest, context: grpc.ServicerContext) -> ps_pb2.ShutdownResponse:
        """Ask the hosting process to exit cleanly."""
        log.info("shutdown requested: %s", request.reason or "(no reason)")
        if self._on_shutdown is not None:
            self._on_shutdown(request.reason)
        return ps_pb2.ShutdownResponse()

    @handles_errors
    def SetBackup(self, request: ps_pb2.SetBackupRequest, context: grpc.ServicerContext) -> ps_pb2.SetBackupResponse:
        """Forward every state change to a backup shard from now on (asyncps.ps.replica), or let it go."""
        if self._on_set_backup is None:
            raise FailedPreconditionError("this shard process keeps no backup")
        address = request.address.strip()
        if address and (len(address) > 255 or ":" not in address or not address.rpartition(":")[2].isdigit()):
            raise InvalidArgumentError(f"a backup's address is host:port, got {request.address[:80]!r}")
        return ps_pb2.SetBackupResponse(version=self._on_set_backup(address))

    @handles_errors
    def Promote(self, request: ps_pb2.PromoteRequest, context: grpc.ServicerContext) -> ps_pb2.PromoteResponse:
        """Take over a dead primary's port: serve there too."""
        if self._on_promote is None:
            raise FailedPreconditionError("this shard process cannot take over another's port")
        if not 0 < request.port < 65536:
            raise InvalidArgumentError(f"the primary's port must be 1-65535, got {request.port}")
        return ps_pb2.PromoteResponse(port=self._on_promote(request.port))


    def rpc_handlers(self) -> dict[str, Handler]:
        """The shard service's control and frame methods: frame methods with pass-through
        (de)serializers, the rest with protobuf's (the names of ps.proto's ParameterServer)."""
        def unary(fn: Callable[..., Any], request: type, reply: type) -> Handler:
            return grpc.unary_unary_rpc_method_handler(fn, request_deserializer=request.FromString,  # type: ignore[attr-defined]
                                                       response_serializer=reply.SerializeToString)  # type: ignore[attr-defined]

        return {
            "Initialize": grpc.stream_unary_rpc_method_handler(
                self.Initialize, request_deserializer=identity,
                response_serializer=ps_pb2.InitializeResponse.SerializeToString),
            "Pull": grpc.unary_stream_rpc_method_handler(
                self.Pull, request_deserializer=ps_pb2.PullRequest.FromString, response_serializer=identity),
            "Push": grpc.stream_unary_rpc_method_handler(
                self.Push, request_deserializer=identity, response_serializer=ps_pb2.PushResult.SerializeToString),
            "PushPull": grpc.stream_stream_rpc_method_handler(
                self.PushPull, request_deserializer=identity, response_serializer=identity),
            "GetStats": unary(self.GetStats, ps_pb2.StatsRequest, ps_pb2.ShardStats),
            "SetLiveWorkers": unary(self.SetLiveWorkers, ps_pb2.LiveWorkersRequest, ps_pb2.LiveWorkersResponse),
            "Pause": unary(self.Pause, ps_pb2.PauseRequest, ps_pb2.PauseResponse),
            "Snapshot": grpc.unary_stream_rpc_method_handler(
                self.Snapshot, request_deserializer=ps_pb2.SnapshotRequest.FromString, response_serializer=identity),
            "Restore": grpc.stream_unary_rpc_method_handler(
                self.Restore, request_deserializer=identity,
                response_serializer=ps_pb2.InitializeResponse.SerializeToString),
            "Shutdown": unary(self.Shutdown, ps_pb2.ShutdownRequest, ps_pb2.ShutdownResponse),
            "SetBackup": unary(self.SetBackup, ps_pb2.SetBackupRequest, ps_pb2.SetBackupResponse),
            "Promote": unary(self.Promote, ps_pb2.PromoteRequest, ps_pb2.PromoteResponse),
        }

    def start(self) -> None:
        """Nothing beyond the gRPC server, which the shard's main starts."""

    def close(self) -> None:
        """Nothing of its own to release."""


def grpc_adapter(side: ShardSide) -> ParameterServerServicer:
    """The registry's shard adapter for "grpc": the servicer over the shard's service."""
    return ParameterServerServicer(side.service, side.chunk_bytes, side.max_request_bytes, side.on_shutdown,
                                   side.plugin_modules, side.on_set_backup, side.on_promote)


__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "SHARD_HANDLER_THREADS", "ParameterServerServicer", "grpc_adapter"]
