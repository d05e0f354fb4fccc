"""gRPC adapter for a shard: proto <-> domain objects, domain errors -> status codes."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Callable, Iterator

import grpc
import numpy as np

from asyncps.codec import (
    DEFAULT_CHUNK_BYTES,
    Array,
    SparseRows,
    TensorAssembler,
    dtype_to_proto,
    framed,
    iter_chunks,
    read_frames,
)
from asyncps.errors import InvalidArgumentError
from asyncps.pb import ps_pb2, ps_pb2_grpc, tensor_pb2
from asyncps.ps.store import ShardStore
from asyncps.rpc import handles_errors
from asyncps.shard import PushOutcome
from asyncps.wire import (
    outcome_to_proto,
    rule_from_proto,
    rule_to_proto,
    snapshot_frames,
    snapshot_from_wire,
    snapshot_header,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 2 << 30
MAX_WAIT_S = 300.0  # longest a long-poll blocks, whatever the caller asks
# Blocking waits (sync steps, SSP gates, long polls) allowed at once; the server has more handler
# threads than this (SHARD_HANDLER_THREADS), so waiters can never starve other calls.
DEFAULT_MAX_WAITERS = 192
SHARD_HANDLER_THREADS = 256


class ParameterServerServicer(ps_pb2_grpc.ParameterServerServicer):
    """Serves one ShardStore over gRPC."""

    def __init__(
        self,
        store: ShardStore,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        on_shutdown: Callable[[str], None] | None = None,
        max_waiters: int = DEFAULT_MAX_WAITERS,
    ) -> None:
        self._store = store
        self._chunk_bytes = chunk_bytes
        self._max_request_bytes = max_request_bytes
        self._on_shutdown = on_shutdown
        self._counter_lock = threading.Lock()
        self._waiters = threading.BoundedSemaphore(max_waiters)
        self._bytes_pulled = 0
        self._bytes_pushed = 0

    def _count(self, pulled: int = 0, pushed: int = 0) -> None:
        with self._counter_lock:
            self._bytes_pulled += pulled
            self._bytes_pushed += pushed

    @handles_errors
    def Initialize(
        self, request_iterator: Iterator[ps_pb2.InitializeChunk], context: grpc.ServicerContext
    ) -> ps_pb2.InitializeResponse:
        """Create the shard's variables and update rule (idempotent)."""
        assembler = TensorAssembler(self._max_request_bytes)
        header = read_frames(request_iterator, assembler, "Initialize")
        rule = rule_from_proto(header.rule)
        values: dict[str, Array] = {}
        for name, value in assembler.finish().items():
            if isinstance(value, SparseRows):
                raise InvalidArgumentError(f"{name}: initial values must be dense")
            values[name] = value
        created = self._store.initialize(rule, values)
        log.info("Initialize from %s: %s (%d variables)", header.worker_id,
                 "created" if created else "identical, accepted", len(values))
        return ps_pb2.InitializeResponse(created=created, version=self._store.version)

    def _pull_stream(
        self, worker_id: str, if_newer_than: int, push: ps_pb2.PushResult | None = None, waited_s: float = 0.0
    ) -> Iterator[ps_pb2.PullChunk]:
        def encode(name: str, value: Array) -> list[tensor_pb2.TensorChunk]:
            return list(iter_chunks(name, value, chunk_bytes=self._chunk_bytes))

        version, incarnation, encoded = self._store.pull_with_incarnation(if_newer_than, encode, worker_id)
        header = ps_pb2.PullHeader(version=version, not_modified=encoded is None,
                                   shard_index=self._store.shard_index, push=push, waited_s=waited_s,
                                   incarnation=incarnation)
        chunks = [c for chunks in encoded or () for c in chunks]
        yield from framed(lambda h, frame: ps_pb2.PullChunk(header=h, tensors=frame), header, chunks,
                          self._chunk_bytes)
        self._count(pulled=sum(len(c.data) for c in chunks))

    def _wait_limit(self, what: str, asked_s: float, context: grpc.ServicerContext, margin_s: float = 0.0) -> float:
        """How long a long-poll may block: what the caller asked, within its deadline and our cap."""
        if not math.isfinite(asked_s) or asked_s < 0:
            raise InvalidArgumentError(f"{what} must be a finite number of seconds >= 0, got {asked_s}")
        remaining = context.time_remaining()
        limit = min(asked_s, MAX_WAIT_S)
        return limit if remaining is None else min(limit, max(0.0, remaining - margin_s))

    @contextlib.contextmanager
    def _waiter(self) -> Iterator[bool]:
        """A slot for a blocking wait; when every slot is taken the call answers at once instead,
        so long polls can never occupy all handler threads."""
        acquired = self._waiters.acquire(blocking=False)
        try:
            yield acquired
        finally:
            if acquired:
                self._waiters.release()

    @handles_errors
    def Pull(self, request: ps_pb2.PullRequest, context: grpc.ServicerContext) -> Iterator[ps_pb2.PullChunk]:
        """Stream the values (optionally after a long-poll for a newer version)."""
        limit = self._wait_limit("wait_timeout_s", request.wait_timeout_s, context)
        if limit > 0:
            with self._waiter() as may_wait:
                if may_wait:
                    self._store.wait_newer(request.if_newer_than, limit)
        yield from self._pull_stream(request.worker_id, request.if_newer_than)

    def _push(
        self, request_iterator: Iterator[ps_pb2.PushChunk], check: Callable[[ps_pb2.PushHeader], None] | None = None
    ) -> tuple[ps_pb2.PushHeader, PushOutcome]:
        assembler = TensorAssembler(self._max_request_bytes)
        header = read_frames(request_iterator, assembler, "Push")
        if check is not None:
            check(header)  # the whole request is validated before the store changes
        grads = assembler.finish()
        outcome = self._store.push(header.worker_id, header.base_version, grads, header.incarnation)
        self._count(pushed=assembler.total_bytes)
        return header, outcome

    @handles_errors
    def Push(
        self, request_iterator: Iterator[ps_pb2.PushChunk], context: grpc.ServicerContext
    ) -> ps_pb2.PushResult:
        """Apply or drop one gradient."""
        _, outcome = self._push(request_iterator)
        return outcome_to_proto(outcome)

    @handles_errors
    def PushPull(
        self, request_iterator: Iterator[ps_pb2.PushChunk], context: grpc.ServicerContext
    ) -> Iterator[ps_pb2.PullChunk]:
        """Push, then stream the values back in the same call."""
        limits: list[float] = []
        header, outcome = self._push(
            request_iterator,
            lambda h: limits.append(self._wait_limit("read_wait_s", h.read_wait_s, context, margin_s=1.0)))
        waited = 0.0
        limit = limits[0]
        if limit > 0:
            with self._waiter() as may_wait:
                if may_wait:
                    waited = self._store.wait_readable(header.worker_id, header.base_version, limit)
        yield from self._pull_stream(header.worker_id, header.pull_if_newer_than, outcome_to_proto(outcome),
                                     waited)

    @handles_errors
    def GetStats(self, request: ps_pb2.StatsRequest, context: grpc.ServicerContext) -> ps_pb2.ShardStats:
        """Counters and variable metadata."""
        stats = self._store.stats()
        with self._counter_lock:
            pulled, pushed = self._bytes_pulled, self._bytes_pushed
        return ps_pb2.ShardStats(
            shard_index=self._store.shard_index,
            initialized=stats.initialized,
            version=stats.version,
            pushes_accepted=stats.pushes_accepted,
            pushes_dropped=stats.pushes_dropped,
            variables=[
                ps_pb2.VariableInfo(name=n, dtype=dtype_to_proto(np.dtype(d)), shape=s)
                for n, d, s in stats.variables
            ],
            rule=rule_to_proto(stats.rule) if stats.rule else None,
            bytes_pulled=pulled,
            bytes_pushed=pushed,
            dropped_by_reason=stats.dropped_by_reason,
            mode_stats=stats.mode_stats,
        )

    @handles_errors
    def SetLiveWorkers(
        self, request: ps_pb2.LiveWorkersRequest, context: grpc.ServicerContext
    ) -> ps_pb2.LiveWorkersResponse:
        """Update the live set used by the consistency model."""
        self._store.set_live_workers(request.worker_ids)
        return ps_pb2.LiveWorkersResponse(version=self._store.version)

    @handles_errors
    def Pause(self, request: ps_pb2.PauseRequest, context: grpc.ServicerContext) -> ps_pb2.PauseResponse:
        """Hold or release pushes (a checkpoint cut)."""
        if request.pause and not 0 < request.max_hold_s <= 600:
            raise InvalidArgumentError("a pause needs max_hold_s in (0, 600] seconds")
        version = self._store.pause(request.max_hold_s if request.pause else 0.0)
        return ps_pb2.PauseResponse(version=version)

    @handles_errors
    def Snapshot(
        self, request: ps_pb2.SnapshotRequest, context: grpc.ServicerContext
    ) -> Iterator[ps_pb2.SnapshotChunk]:
        """Stream the whole state for a checkpoint."""
        snap = self._store.snapshot()
        yield from snapshot_frames(snapshot_header(snap, self._store.shard_index), snap, self._chunk_bytes)

    @handles_errors
    def Restore(
        self, request_iterator: Iterator[ps_pb2.SnapshotChunk], context: grpc.ServicerContext
    ) -> ps_pb2.InitializeResponse:
        """Replace the state with a checkpoint's part."""
        assembler = TensorAssembler(self._max_request_bytes)
        header = read_frames(request_iterator, assembler, "Restore")
        snap = snapshot_from_wire(header, assembler.finish())
        self._store.restore(snap)
        log.info("restored %d variables at version %d", len(snap.values), snap.version)
        return ps_pb2.InitializeResponse(created=True, version=snap.version)

    @handles_errors
    def Shutdown(
        self, request: ps_pb2.ShutdownRequest, context: grpc.ServicerContext
    ) -> ps_pb2.ShutdownResponse:
        """Ask the hosting process to exit cleanly."""
        log.info("shutdown requested: %s", request.reason or "(no reason)")
        if self._on_shutdown is not None:
            self._on_shutdown(request.reason)
        return ps_pb2.ShutdownResponse()
