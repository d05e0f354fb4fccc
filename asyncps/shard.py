"""What a shard answers, as domain types: push outcomes, snapshots and stats.

The shard's state object produces them, the transport carries them, the worker and the chief read
them; none of them knows about protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncps.codec import Array
from asyncps.rules import UpdateRuleConfig


@dataclass(frozen=True)
class PushOutcome:
    """The shard's answer to one push."""

    accepted: bool
    staleness: int
    version: int
    effective_lr: float
    drop_reason: str = ""


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
