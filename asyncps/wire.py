"""The wire contract in domain terms: protobuf messages <-> rules, push outcomes and snapshots.

Every conversion between a protobuf message of the shard service and a domain type lives here,
so roles and tools never build or read those messages field by field.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from asyncps.codec import Array, Gradient, SparseRows, framed, iter_chunks
from asyncps.errors import InvalidArgumentError
from asyncps.pb import ps_pb2
from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.shard import PushOutcome, Snapshot


def rule_to_proto(rule: UpdateRuleConfig) -> ps_pb2.UpdateRule:
    """Encode an update rule for the wire: the canonical spec of each kind."""
    return ps_pb2.UpdateRule(optimizer=rule.optimizer.spec, mode=rule.mode,
                             staleness_policy=rule.staleness_policy, num_workers=rule.num_workers)


def rule_from_proto(msg: ps_pb2.UpdateRule) -> UpdateRuleConfig:
    """Decode and validate an update rule; a malformed spec is InvalidArgumentError."""
    try:
        return UpdateRuleConfig(
            optimizer=OptimizerConfig.parse(msg.optimizer),
            mode=msg.mode or "async",
            staleness_policy=msg.staleness_policy or "none",
            num_workers=msg.num_workers or 1,
        )
    except ValueError as exc:
        raise InvalidArgumentError(f"bad update rule: {exc}") from None


def outcome_to_proto(outcome: PushOutcome) -> ps_pb2.PushResult:
    """Encode a push outcome."""
    return ps_pb2.PushResult(
        accepted=outcome.accepted,
        staleness=outcome.staleness,
        version=outcome.version,
        effective_lr=outcome.effective_lr,
        drop_reason=outcome.drop_reason,
    )


def snapshot_header(snap: Snapshot, shard_index: int) -> ps_pb2.SnapshotHeader:
    """The header of a snapshot stream: rule, version and counters."""
    return ps_pb2.SnapshotHeader(rule=rule_to_proto(snap.rule), version=snap.version,
                                 pushes_accepted=snap.accepted, pushes_dropped=snap.dropped,
                                 updates=snap.updates, shard_index=shard_index)


def snapshot_frames(
    header: ps_pb2.SnapshotHeader, snap: Snapshot, chunk_bytes: int
) -> Iterator[ps_pb2.SnapshotChunk]:
    """A snapshot as a stream of frames: the header first, then values and slots."""
    chunks = itertools.chain(
        (c for name, value in snap.values.items()
         for c in iter_chunks(f"value/{name}", value, chunk_bytes=chunk_bytes)),
        (c for name, slots in snap.slots.items() for slot, a in slots.items()
         for c in iter_chunks(f"slot/{slot}/{name}", a, chunk_bytes=chunk_bytes)),
    )
    return framed(lambda h, frame: ps_pb2.SnapshotChunk(header=h, tensors=frame), header, chunks, chunk_bytes)


def snapshot_from_wire(header: ps_pb2.SnapshotHeader, tensors: dict[str, Gradient]) -> Snapshot:
    """Rebuild a Snapshot from its header and assembled tensors, checking the names."""
    values: dict[str, Array] = {}
    slots: dict[str, dict[str, Array]] = {}
    for key, tensor in tensors.items():
        if isinstance(tensor, SparseRows):
            raise InvalidArgumentError(f"{key}: snapshot tensors must be dense")
        kind, _, rest = key.partition("/")
        if kind == "value" and rest:
            values[rest] = tensor
        elif kind == "slot" and "/" in rest:
            slot, _, name = rest.partition("/")
            slots.setdefault(name, {})[slot] = tensor
        else:
            raise InvalidArgumentError(f"snapshot tensor {key!r}: expected value/NAME or slot/SLOT/NAME")
    if set(slots) - set(values):
        raise InvalidArgumentError(f"slots for unknown variables {sorted(set(slots) - set(values))}")
    return Snapshot(rule=rule_from_proto(header.rule), version=header.version, accepted=header.pushes_accepted,
                    dropped=header.pushes_dropped, values=values, slots=slots, updates=dict(header.updates))
