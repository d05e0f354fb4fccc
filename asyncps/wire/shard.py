"""What a shard answers, as domain types: push outcomes, snapshots and stats.

The shard's state object produces them, the transport carries them, the worker and the chief read
them; none of them knows about protobuf.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from asyncps.rules import UpdateRuleConfig
from asyncps.rules.drops import DropReason
from asyncps.rules.initializers import TableSpec
from asyncps.rules.sync.types import Ballot, Decisions
from asyncps.wire.codec import Array, Gradient, SparseRows


@dataclass(frozen=True)
class RowStaleness:
    """Per-row staleness of one push: over the rows its sparse gradients touched (those sent with the
    clocks they were read at), how many updates each row had received since the worker read it; of
    them, the hot rows' (asyncps.ps.store.HOT_SHARE: rows in at least 1 of 100 of their table's updates)
    and the rows a per-row staleness policy dropped."""

    rows: int
    mean: float
    p95: float
    max: int
    dropped: int = 0  # rows a per-row policy dropped (not applied)
    hot_rows: int = 0  # rows that were hot when the push arrived
    hot_mean: float = 0.0  # their mean staleness (0 when none)

    @staticmethod
    def of(staleness: Array, hot: Array | None = None, dropped: int = 0) -> RowStaleness | None:
        """The summary of per-row staleness values (None for none); `hot`: which rows are hot."""
        if staleness.size == 0:
            return None
        hot_rows = int(np.count_nonzero(hot)) if hot is not None else 0
        hot_mean = float(staleness[hot].mean()) if hot is not None and hot_rows else 0.0
        return RowStaleness(int(staleness.size), float(staleness.mean()),
                            float(np.percentile(staleness, 95)), int(staleness.max()), dropped, hot_rows, hot_mean)

    @property
    def cold_mean(self) -> float:
        """The mean staleness of the rows that were not hot (0 when none)."""
        cold = self.rows - self.hot_rows
        return (self.mean * self.rows - self.hot_mean * self.hot_rows) / cold if cold else 0.0


@dataclass(frozen=True)
class PushOutcome:
    """The shard's answer to one push: applied (or accumulated), or dropped for a reason."""

    accepted: bool
    staleness: int
    version: int
    effective_lr: float
    drop: DropReason | None = None
    detail: str = ""  # a human-readable explanation of a drop
    # the answer's number among the shard state's answers (asyncps.ps.store.Answers); 0: not the answer
    # a worker records (a gradient staged on a sync follower), or from an older shard. Bookkeeping,
    # not part of what became of the push: outcomes compare equal without it
    seq: int = field(default=0, compare=False)
    # per-row staleness of the rows the push's sparse gradients touched (None: no row sent its clock)
    rows: RowStaleness | None = field(default=None, compare=False)
    # the incarnation of the shard's state that gave (and numbered) the answer: the one whose restores
    # can take it back, also for a push sent to an earlier incarnation; 0: not said (an older shard)
    incarnation: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        if self.accepted == (self.drop is not None):
            raise ValueError("a push is either accepted or dropped for a reason, not both or neither")


@dataclass(frozen=True)
class PushRequest:
    """One step's gradient for one shard, with what it was computed from."""

    worker_id: str
    base_version: int
    grads: Mapping[str, Gradient]
    step: int = 0
    loss: float = 0.0
    incarnation: int = 0  # of the values the gradient was computed from; 0: not checked
    ballot: Ballot | None = None  # sync: the coordinator version it was computed from
    decisions: Decisions | None = None  # sync commit: the coordinator's decisions (no gradients then)
    worker_index: int | None = None  # the pushing worker's index, when it says (for staleness policies)


@dataclass(frozen=True)
class ShardValues:
    """A shard's values at one version, or None when not newer than the caller asked.

    The arrays are read-only and never change afterwards (the shard copies a variable before
    its next update while a reader may hold it), so they can be encoded without any lock held.
    """

    version: int
    incarnation: int
    values: Mapping[str, Array] | None
    waited_s: float = 0.0  # time the consistency model held the reply back (sync/ssp)
    decisions: Decisions | None = None  # from the sync coordinator: steps decided since the caller's
    # arrays the path receives this shard's values into by itself, this time and every next time (shared
    # memory: the segment's value regions, written by the shard): a caller that takes them as its buffers
    # computes from them in place instead of copying each reply out (asyncps.transport.ModelClient)
    lent: Mapping[str, Array] | None = None
    # the row reads asked for, by part: the rows (indices as asked, values, clocks), served whatever the
    # version (a part read by rows is never among `values`)
    rows: Mapping[str, SparseRows] | None = None


@dataclass(frozen=True)
class LiveBlob:
    """The live part of a shard's state that a snapshot leaves out, encoded (asyncps.ps.live_state): a JSON
    tree of plain values and named classes whose arrays are `arrays`, by index."""

    tree: bytes
    arrays: tuple[Array, ...] = ()


@dataclass(frozen=True)
class Snapshot:
    """Everything a shard needs to continue from where it was: a checkpoint's part."""

    rule: UpdateRuleConfig
    version: int
    accepted: int
    dropped: int
    values: dict[str, Array]
    slots: dict[str, dict[str, Array]]
    updates: dict[str, int]
    run_id: str = ""  # the run this state belongs to (empty: none said)
    # the staleness policy's per-row state (asyncps.ps.policy_state): variable -> arrays
    policy_state: dict[str, dict[str, Array]] = field(default_factory=dict)
    answers: int = 0  # the answers to pushes the state had given, in all and by worker index
    answers_by_worker: dict[int, int] = field(default_factory=dict)
    # the keyed parts (asyncps.ps.keyed) with their specs: their keys ride in policy_state, by row
    keyed: dict[str, TableSpec] = field(default_factory=dict)
    # a restore: the incarnation the restored state takes (chosen by the chief, recorded before the
    # restore happens); 0: the shard draws one. A snapshot read from a shard: 0
    incarnation: int = 0
    # a backup seeded from a live primary (asyncps.ps.replica): the state's live part (mode state, read
    # values, retry memo, drop reasons, row clocks); None: a checkpoint's part, which starts them over
    live: LiveBlob | None = None


@dataclass(frozen=True)
class StoreStats:
    """Counters and metadata of a shard (no values)."""

    initialized: bool
    version: int
    pushes_accepted: int
    pushes_dropped: int
    variables: tuple[tuple[str, str, tuple[int, ...]], ...]
    rule: UpdateRuleConfig | None
    dropped_by_reason: dict[str, int] = field(default_factory=dict)
    mode_stats: dict[str, float] = field(default_factory=dict)
    shard_index: int = 0
    bytes_pulled: int = 0  # tensor bytes served and received by the shard's transport
    bytes_pushed: int = 0
    # the same, by the transport that carried them ("grpc", "tcp", "shm")
    bytes_pulled_by_transport: dict[str, int] = field(default_factory=dict)
    bytes_pushed_by_transport: dict[str, int] = field(default_factory=dict)
    run_id: str = ""  # the run that initialized or restored the shard (empty: none said)
    # the answers to pushes the state has given (the ones workers record), in all and by worker index
    answers: int = 0
    answers_by_worker: dict[int, int] = field(default_factory=dict)

    def bytes_by_transport(self) -> dict[str, dict[str, int]]:
        """{transport: {"pushed": bytes, "pulled": bytes}} for each transport that carried any."""
        names = sorted(set(self.bytes_pushed_by_transport) | set(self.bytes_pulled_by_transport))
        return {name: {"pushed": self.bytes_pushed_by_transport.get(name, 0),
                       "pulled": self.bytes_pulled_by_transport.get(name, 0)} for name in names}


__all__ = ["Ballot", "Decisions", "DropReason", "LiveBlob", "PushOutcome", "PushRequest", "RowStaleness", "ShardValues",
           "Snapshot", "StoreStats"]
