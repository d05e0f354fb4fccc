"""The wire contract in domain terms: protobuf messages <-> rules, push outcomes and snapshots.

Every conversion between a protobuf message of the shard service and a domain type lives here,
so roles and tools never build or read those messages field by field.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping

import numpy as np

from asyncps.errors import InvalidArgumentError, PermissionDeniedError
from asyncps.pb import coordinator_pb2, ps_pb2, tensor_pb2
from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.rules.initializers import RowInit, TableSpec
from asyncps.rules.registry import PluginNotAllowed
from asyncps.rules.sync.types import SyncStep
from asyncps.wire.codec import (
    MAX_RANK,
    Array,
    Gradient,
    IndexArray,
    SparseRows,
    TensorAssembler,
    dtype_from_proto,
    dtype_to_proto,
    iter_chunks,
)
from asyncps.wire.frames import frames, gradient_slices, parser, row_id_slices, served_row_slices, tensor_slices
from asyncps.wire.shard import (
    Ballot,
    Decisions,
    DropReason,
    LiveBlob,
    PushOutcome,
    PushRequest,
    RowStaleness,
    Snapshot,
    StoreStats,
)


def rule_to_proto(rule: UpdateRuleConfig) -> ps_pb2.UpdateRule:
    """Encode an update rule for the wire: the canonical spec of each kind."""
    return ps_pb2.UpdateRule(optimizer=rule.optimizer.spec, mode=rule.mode,
                             staleness_policy=rule.staleness_policy, num_workers=rule.num_workers,
                             state=list(rule.state))


def rule_from_proto(msg: ps_pb2.UpdateRule) -> UpdateRuleConfig:
    """Decode and validate an update rule; a malformed spec is InvalidArgumentError, a plugin module
    may not be imported here (asyncps.rules.registry.plugin_modules_only) PermissionDeniedError."""
    try:
        return UpdateRuleConfig(
            optimizer=OptimizerConfig.parse(msg.optimizer),
            mode=msg.mode or "async",
            staleness_policy=msg.staleness_policy or "none",
            num_workers=msg.num_workers or 1,
            state=tuple(msg.state),
        )
    except PluginNotAllowed as exc:
        raise PermissionDeniedError(f"update rule refused: {exc}") from None
    except ValueError as exc:
        raise InvalidArgumentError(f"bad update rule: {exc}") from None


_DROP_TO_WIRE: dict[DropReason, ps_pb2.DropReason.ValueType] = {
    DropReason.STALE: ps_pb2.DROP_STALE,
    DropReason.LATE: ps_pb2.DROP_LATE,
    DropReason.DUPLICATE: ps_pb2.DROP_DUPLICATE,
    DropReason.RESTORED: ps_pb2.DROP_RESTORED,
    DropReason.NONFINITE: ps_pb2.DROP_NONFINITE,
}
_DROP_FROM_WIRE = {number: reason for reason, number in _DROP_TO_WIRE.items()}


def drop_to_wire(reason: DropReason | None) -> ps_pb2.DropReason.ValueType:
    """The proto enum of a drop reason (DROP_NONE for an accepted push)."""
    return ps_pb2.DROP_NONE if reason is None else _DROP_TO_WIRE[reason]


def drop_from_wire(number: int) -> DropReason | None:
    """The drop reason of a proto enum number; an unknown number is InvalidArgumentError."""
    if number == ps_pb2.DROP_NONE:
        return None
    try:
        return _DROP_FROM_WIRE[number]  # type: ignore[index]
    except KeyError:
        raise InvalidArgumentError(f"unknown drop reason {number}") from None


def outcome_to_proto(outcome: PushOutcome) -> ps_pb2.PushResult:
    """Encode a push outcome."""
    return ps_pb2.PushResult(
        accepted=outcome.accepted,
        staleness=outcome.staleness,
        version=outcome.version,
        effective_lr=outcome.effective_lr,
        drop=drop_to_wire(outcome.drop),
        drop_detail=outcome.detail,
        seq=outcome.seq,
        incarnation=outcome.incarnation,
        rows=None if outcome.rows is None else ps_pb2.RowStaleness(
            rows=outcome.rows.rows, mean=outcome.rows.mean, p95=outcome.rows.p95, max=outcome.rows.max,
            dropped=outcome.rows.dropped, hot_rows=outcome.rows.hot_rows, hot_mean=outcome.rows.hot_mean),
    )


def outcome_from_proto(msg: ps_pb2.PushResult) -> PushOutcome:
    """Decode a push outcome; an inconsistent one is InvalidArgumentError."""
    rows = None
    if msg.HasField("rows") and msg.rows.rows:
        r = msg.rows
        if r.rows < 0 or r.max < 0 or not 0 <= r.dropped <= r.rows or not 0 <= r.hot_rows <= r.rows:
            raise InvalidArgumentError(f"bad push result: row staleness over {r.rows} rows, max {r.max}, "
                                       f"{r.dropped} dropped, {r.hot_rows} hot")
        rows = RowStaleness(r.rows, r.mean, r.p95, r.max, r.dropped, r.hot_rows, r.hot_mean)
    try:
        return PushOutcome(msg.accepted, msg.staleness, msg.version, msg.effective_lr, drop_from_wire(msg.drop),
                           msg.drop_detail, msg.seq, rows=rows, incarnation=msg.incarnation)
    except ValueError as exc:
        raise InvalidArgumentError(f"bad push result: {exc}") from None


def decisions_to_proto(decisions: Decisions) -> ps_pb2.SyncDecisions:
    """Encode the sync coordinator's decisions."""
    return ps_pb2.SyncDecisions(incarnation=decisions.incarnation, steps=[
        ps_pb2.SyncStep(step=s.step, workers=sorted(s.workers)) for s in decisions.steps])


def decisions_from_proto(msg: ps_pb2.SyncDecisions) -> Decisions:
    """Decode the sync coordinator's decisions; they must come in increasing step order."""
    steps = tuple(SyncStep(s.step, frozenset(s.workers)) for s in msg.steps)
    if any(b.step <= a.step for a, b in itertools.pairwise(steps)) or (steps and steps[0].step < 0):
        raise InvalidArgumentError("sync decisions must have increasing steps >= 0")
    if msg.incarnation <= 0:
        raise InvalidArgumentError("sync decisions need the coordinator's incarnation (> 0)")
    return Decisions(msg.incarnation, steps)


def push_header(request: PushRequest, pull_if_newer_than: int = -1, read_wait_s: float = 0.0) -> ps_pb2.PushHeader:
    """The header of a push (or push-pull) of `request`; the worker index only when known."""
    header = ps_pb2.PushHeader(worker_id=request.worker_id, base_version=request.base_version, step=request.step,
                               loss=request.loss, pull_if_newer_than=pull_if_newer_than, read_wait_s=read_wait_s,
                               incarnation=request.incarnation, worker_index=request.worker_index)
    if request.ballot is not None:
        header.sync_step, header.sync_incarnation = request.ballot.step, request.ballot.incarnation
    if request.decisions is not None:
        header.sync.CopyFrom(decisions_to_proto(request.decisions))
    return header


def push_request(header: ps_pb2.PushHeader, grads: Mapping[str, Gradient]) -> PushRequest:
    """The push a header (and its gradients) asks for; a malformed ballot or a negative worker index is
    InvalidArgumentError."""
    ballot = None
    if header.sync_incarnation:
        if header.sync_step < 0 or header.sync_incarnation < 0:
            raise InvalidArgumentError("sync_step and sync_incarnation must be >= 0")
        ballot = Ballot(header.sync_step, header.sync_incarnation)
    decisions = decisions_from_proto(header.sync) if header.HasField("sync") else None
    worker_index = header.worker_index if header.HasField("worker_index") else None
    if worker_index is not None and worker_index < 0:
        raise InvalidArgumentError(f"worker_index must be >= 0 when given, got {worker_index}")
    return PushRequest(header.worker_id, header.base_version, grads, header.step, header.loss, header.incarnation,
                       ballot, decisions, worker_index)


def push_record(
    outcome: PushOutcome, wall_time: float, shard: int, base_version: int, loss: float, step: int,
    local_steps: int = 1, incarnation: int = 0,
) -> coordinator_pb2.PushRecord:
    """The telemetry record of one push, as a worker reports it to the chief (`local_steps`: the
    steps of local SGD its model change carried; 1 for a gradient). Its incarnation is the one of the
    shard's state that answered (and numbered) it, else (an older shard) `incarnation`, the one it was
    sent to."""
    record = coordinator_pb2.PushRecord(
        wall_time=wall_time, shard=shard, base_version=base_version, version=outcome.version,
        staleness=outcome.staleness, accepted=outcome.accepted, effective_lr=outcome.effective_lr, loss=loss,
        step=step, drop=drop_to_wire(outcome.drop), drop_detail=outcome.detail, local_steps=local_steps,
        incarnation=outcome.incarnation or incarnation, seq=outcome.seq)
    rows = outcome.rows
    if rows is not None:  # per-row staleness (tables read by rows)
        record.rows, record.row_staleness_mean, record.row_staleness_p95 = rows.rows, rows.mean, rows.p95
        record.row_staleness_max = rows.max
        record.rows_dropped, record.hot_rows, record.hot_row_staleness_mean = rows.dropped, rows.hot_rows, rows.hot_mean
    return record


def stats_to_proto(stats: StoreStats) -> ps_pb2.ShardStats:
    """Encode a shard's counters and variable metadata."""
    return ps_pb2.ShardStats(
        shard_index=stats.shard_index,
        initialized=stats.initialized,
        version=stats.version,
        pushes_accepted=stats.pushes_accepted,
        pushes_dropped=stats.pushes_dropped,
        variables=[ps_pb2.VariableInfo(name=n, dtype=dtype_to_proto(np.dtype(d)), shape=s)
                   for n, d, s in stats.variables],
        rule=rule_to_proto(stats.rule) if stats.rule else None,
        bytes_pulled=stats.bytes_pulled,
        bytes_pushed=stats.bytes_pushed,
        bytes_pulled_by_transport=stats.bytes_pulled_by_transport,
        bytes_pushed_by_transport=stats.bytes_pushed_by_transport,
        dropped_by_reason=stats.dropped_by_reason,
        mode_stats=stats.mode_stats,
        run_id=stats.run_id,
        answers=stats.answers,
        answers_by_worker=stats.answers_by_worker,
    )


def stats_from_proto(msg: ps_pb2.ShardStats) -> StoreStats:
    """Decode a shard's counters and variable metadata."""
    return StoreStats(
        initialized=msg.initialized,
        version=msg.version,
        pushes_accepted=msg.pushes_accepted,
        pushes_dropped=msg.pushes_dropped,
        variables=tuple((v.name, dtype_from_proto(v.dtype).name, tuple(v.shape)) for v in msg.variables),
        rule=rule_from_proto(msg.rule) if msg.HasField("rule") else None,
        dropped_by_reason=dict(msg.dropped_by_reason),
        mode_stats=dict(msg.mode_stats),
        shard_index=msg.shard_index,
        bytes_pulled=msg.bytes_pulled,
        bytes_pushed=msg.bytes_pushed,
        bytes_pulled_by_transport=dict(msg.bytes_pulled_by_transport),
        bytes_pushed_by_transport=dict(msg.bytes_pushed_by_transport),
        run_id=msg.run_id,
        answers=msg.answers,
        answers_by_worker=dict(msg.answers_by_worker),
    )


def snapshot_header(snap: Snapshot, shard_index: int) -> ps_pb2.SnapshotHeader:
    """The header of a snapshot stream: rule, version and counters."""
    return ps_pb2.SnapshotHeader(rule=rule_to_proto(snap.rule), version=snap.version,
                                 pushes_accepted=snap.accepted, pushes_dropped=snap.dropped,
                                 updates=snap.updates, shard_index=shard_index, run_id=snap.run_id,
                                 answers=snap.answers, answers_by_worker=snap.answers_by_worker,
                                 keyed=generated_to_proto(snap.keyed), incarnation=snap.incarnation,
                                 live_tree=snap.live.tree if snap.live is not None else b"")


def snapshot_frames(
    header: ps_pb2.SnapshotHeader, snap: Snapshot, chunk_bytes: int
) -> Iterator[bytes]:
    """A snapshot as a stream of raw frames: the header first, then values, slots and policy state."""
    slices = itertools.chain(
        (s for name, value in snap.values.items()
         for s in tensor_slices(f"value/{name}", value, chunk_bytes=chunk_bytes)),
        (s for name, slots in snap.slots.items() for slot, a in slots.items()
         for s in tensor_slices(f"slot/{slot}/{name}", a, chunk_bytes=chunk_bytes)),
        (s for name, state in snap.policy_state.items() for key, a in state.items()
         for s in tensor_slices(f"policy/{key}/{name}", a, chunk_bytes=chunk_bytes)),
        (s for index, a in enumerate(snap.live.arrays if snap.live is not None else ())
         for s in tensor_slices(f"live/{index}", a, chunk_bytes=chunk_bytes)),
    )
    return frames(lambda h, chunks: ps_pb2.SnapshotChunk(header=h, tensors=chunks), header, slices, chunk_bytes)


def snapshot_from_wire(header: ps_pb2.SnapshotHeader, tensors: dict[str, Gradient]) -> Snapshot:
    """Rebuild a Snapshot from its header and assembled tensors, checking the names."""
    values: dict[str, Array] = {}
    slots: dict[str, dict[str, Array]] = {}
    policy_state: dict[str, dict[str, Array]] = {}
    live: dict[int, Array] = {}
    for key, tensor in tensors.items():
        if isinstance(tensor, SparseRows):
            raise InvalidArgumentError(f"{key}: snapshot tensors must be dense")
        kind, _, rest = key.partition("/")
        if kind == "value" and rest:
            values[rest] = tensor
        elif kind == "live" and rest.isdigit() and header.live_tree:
            live[int(rest)] = tensor
        elif kind in ("slot", "policy") and "/" in rest:
            slot, _, name = rest.partition("/")
            (slots if kind == "slot" else policy_state).setdefault(name, {})[slot] = tensor
        else:
            raise InvalidArgumentError(
                f"snapshot tensor {key!r}: expected value/NAME, slot/SLOT/NAME, policy/KEY/NAME or live/INDEX "
                "(with a live tree)")
    if set(slots) - set(values):
        raise InvalidArgumentError(f"slots for unknown variables {sorted(set(slots) - set(values))}")
    if sorted(live) != list(range(len(live))):
        raise InvalidArgumentError(f"live tensors numbered {sorted(live)[:10]}: expected 0..{len(live) - 1}")
    return Snapshot(rule=rule_from_proto(header.rule), version=header.version, accepted=header.pushes_accepted,
                    dropped=header.pushes_dropped, values=values, slots=slots, updates=dict(header.updates),
                    policy_state=policy_state, run_id=header.run_id, answers=header.answers,
                    answers_by_worker=dict(header.answers_by_worker), keyed=generated_from_proto(header.keyed),
                    incarnation=header.incarnation,
                    live=LiveBlob(header.live_tree, tuple(live[i] for i in range(len(live))))
                    if header.live_tree else None)


# -- the shard service's streams ---------------------------------------------------------------
# Which methods of asyncps.pb.ParameterServer carry raw frames (asyncps.wire.frames) instead of plain
# protobuf messages, in each direction; the other methods are plain protobuf.
SHARD_SERVICE = "asyncps.pb.ParameterServer"
FRAMED_REQUESTS = frozenset({"Initialize", "Push", "PushPull", "Restore"})
FRAMED_REPLIES = frozenset({"Pull", "PushPull", "Snapshot"})
parse_initialize = parser(ps_pb2.InitializeChunk)
parse_push = parser(ps_pb2.PushChunk)
parse_pull = parser(ps_pb2.PullChunk)
parse_snapshot = parser(ps_pb2.SnapshotChunk)


def initialize_frames(
    header: ps_pb2.InitializeHeader, values: Mapping[str, Array], chunk_bytes: int
) -> Iterator[bytes]:
    """An Initialize request: header, then the initial values (a header-only frame when none)."""
    slices = (s for name, value in values.items() for s in tensor_slices(name, value, chunk_bytes=chunk_bytes))
    return frames(lambda h, chunks: ps_pb2.InitializeChunk(header=h, tensors=chunks), header, slices, chunk_bytes)


def push_frames(
    header: ps_pb2.PushHeader, grads: Mapping[str, Gradient], chunk_bytes: int,
    rows: Mapping[str, IndexArray] | None = None,
) -> Iterator[bytes]:
    """A Push or PushPull request: header, then the gradients (dense or sparse rows, with their clocks),
    then the row ids a push-pull reads (ROW_IDS)."""
    slices = itertools.chain((s for name, grad in grads.items() for s in gradient_slices(name, grad, chunk_bytes)),
                             row_id_slices(rows or {}, chunk_bytes))
    return frames(lambda h, chunks: ps_pb2.PushChunk(header=h, tensors=chunks), header, slices, chunk_bytes)


def row_ids_to_proto(rows: Mapping[str, IndexArray] | None) -> list[tensor_pb2.TensorChunk]:
    """The ROW_IDS chunks of a PullRequest (bytes in `data`): the rows asked of each part, as given (see
    asyncps.wire.frames.row_id_slices)."""
    return [c for name, ids in (rows or {}).items() for c in iter_chunks(name, np.asarray(ids), tensor_pb2.ROW_IDS)]


def row_ids_from_proto(chunks: Iterable[tensor_pb2.TensorChunk], max_bytes: int) -> dict[str, IndexArray]:
    """The rows a PullRequest asks for by part (at most max_bytes of ids); anything but ROW_IDS chunks of
    int64 [k] is InvalidArgumentError (order, range and count are the store's to check)."""
    assembler = TensorAssembler(max_bytes)
    for chunk in chunks:
        assembler.add(chunk)
    return rows_of_request(assembler, "pull")


def rows_of_request(assembler: TensorAssembler, kind: str) -> dict[str, IndexArray]:
    """The row ids of a request that carries nothing else (a pull, shared memory's doorbell)."""
    tensors, ids = assembler.finish_request()
    if tensors:
        raise InvalidArgumentError(f"{sorted(tensors)}: a {kind} request carries row ids (ROW_IDS) only")
    return ids


def generated_to_proto(generated: Mapping[str, TableSpec] | None) -> list[ps_pb2.GeneratedTable]:
    """The parts a shard makes itself, as InitializeHeader.generated."""
    return [ps_pb2.GeneratedTable(name=name, dtype=dtype_to_proto(np.dtype(spec.dtype)), shape=spec.shape,
                                  row_start=spec.row_start, init=spec.init.spec, keyed=spec.keyed)
            for name, spec in (generated or {}).items()]


def generated_from_proto(tables: Iterable[ps_pb2.GeneratedTable]) -> dict[str, TableSpec]:
    """Decode InitializeHeader.generated; a nameless or repeated part, a bad dtype, shape or initializer
    spec is InvalidArgumentError (what fits in memory is the store's to check)."""
    out: dict[str, TableSpec] = {}
    for table in tables:
        if not table.name or table.name in out:
            raise InvalidArgumentError(f"generated table {table.name!r}: " + ("named twice" if table.name else
                                                                               "without a name"))
        shape = tuple(int(d) for d in table.shape)
        if not shape or len(shape) > MAX_RANK or min(shape) < 0 or table.row_start < 0:
            raise InvalidArgumentError(f"generated table {table.name}: shape {list(shape)} and first row "
                                       f"{table.row_start} must have 1 to {MAX_RANK} dimensions, all >= 0")
        try:
            init = RowInit.parse(table.init)
        except ValueError as exc:
            raise InvalidArgumentError(f"generated table {table.name}: {exc}") from None
        if table.keyed and (len(shape) < 2 or shape[0] < 1):
            raise InvalidArgumentError(f"generated table {table.name}: a keyed table keeps [bound >= 1, ...] rows, "
                                       f"got shape {list(shape)}")
        out[table.name] = TableSpec(shape, dtype_from_proto(table.dtype).name, table.row_start, init, table.keyed)
    return out


def pull_header_frame(header: ps_pb2.PullHeader) -> bytes:
    """The first frame of a pull reply: the header alone (the values follow, cached per version)."""
    return next(frames(lambda h, chunks: ps_pb2.PullChunk(header=h, tensors=chunks), header, ()))


def value_frames(values: Mapping[str, Array], chunk_bytes: int) -> list[bytes]:
    """The frames after a pull reply's header: every value, no header (the same for every reader
    of one version, so a shard encodes them once)."""
    slices = (s for name, value in values.items() for s in tensor_slices(name, value, chunk_bytes=chunk_bytes))
    out = list(frames(lambda h, chunks: ps_pb2.PullChunk(tensors=chunks), None, slices, chunk_bytes))
    return out if values else []


def row_frames(rows: Mapping[str, SparseRows], chunk_bytes: int) -> list[bytes]:
    """The frames of a pull reply's row reads, after its values: per part, the rows and their clocks
    (encoded for each request: rows asked differ from one reader to the next)."""
    if not rows:
        return []
    return list(frames(lambda h, chunks: ps_pb2.PullChunk(tensors=chunks), None, served_row_slices(rows, chunk_bytes),
                       chunk_bytes))
