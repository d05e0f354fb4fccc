"""The multi-shard sync protocol's messages as domain types: ballots, decisions, resolutions, holds.

They travel on the wire (asyncps.wire.proto converts them) and are read by the shard, the worker
and the chief; this module imports nothing of the project, so every layer may use it.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncps.rules.drops import DropReason


@dataclass(frozen=True)
class Ballot:
    """The coordinator's version (`step`) and incarnation a gradient was computed from.

    A worker of a coordinated mode sends it with every push of a step, so a follower shard knows
    which of the coordinator's decisions the gradient belongs to."""

    step: int
    incarnation: int


@dataclass(frozen=True)
class SyncStep:
    """The coordinator's decision for one step: version `step` + 1 averages exactly these workers."""

    step: int
    workers: frozenset[str]


@dataclass(frozen=True)
class Decisions:
    """Consecutive decisions of one coordinator incarnation, oldest first."""

    incarnation: int
    steps: tuple[SyncStep, ...] = ()


@dataclass(frozen=True)
class Resolution:
    """What became of a staged gradient on a follower: applied in the step that made `version`,
    or dropped for a reason."""

    accepted: bool
    version: int
    staleness: int
    drop: DropReason | None = None
    reason: str = ""


@dataclass(frozen=True)
class Held:
    """A shard's answer to a pause: its version and, in a coordinated mode, where it stands.

    A follower says which coordinator incarnation it follows and the first step it has not
    committed; the coordinator answers the decisions the pause asked for. A cut uses them to
    bring every follower to the coordinator's step while all shards are held."""

    version: int
    follower: bool = False
    lineage: int = 0
    next_step: int = 0
    decided: Decisions | None = None


__all__ = ["Ballot", "Decisions", "Held", "Resolution", "SyncStep"]
