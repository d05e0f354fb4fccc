"""The multi-shard sync protocol's messages as domain types: ballots, decisions, resolutions, holds.

They travel on the wire (asyncps.wire.proto converts them) and are read by the shard, the worker
and the chief; this module imports nothing of the project, so every layer may use it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from asyncps.rules.drops import DropReason


@dataclass(frozen=True)
class Ballot:
    """The coordinator's version (`step`) and incarnation a gradient was computed from.

    A worker of a coordinated mode sends it with every push of a step, so a follower shard knows
    which of the coordinator's decisions the gradient belongs to. `push` is the worker's step
    the gradient is from (the shard sets it from the push): it names the gradient itself, for
    modes whose decided sets name pushes (the K-variants), not workers."""

    step: int
    incarnation: int
    push: int | None = None

    def naming(self, push: int | None) -> Ballot:
        """This ballot naming the worker's step `push` the gradient is from (the shard's one rewrite
        of a ballot; unchanged when it names one already or push is None)."""
        return self if self.push is not None or push is None else dataclasses.replace(self, push=push)


@dataclass(frozen=True)
class SyncStep:
    """The coordinator's decision for one step: version `step` + 1 averages exactly these workers'
    gradients of that step (sync), or exactly these pushes (`push_name`s, the K-variants)."""

    step: int
    workers: frozenset[str]


def push_name(worker_id: str, push: int) -> str:
    """How a decided set names one push: the worker and its step (`worker#step`)."""
    return f"{worker_id}#{push}"


def parse_push_name(name: str) -> tuple[str, int] | None:
    """(worker, step) of a push_name; None for a name that is not one."""
    worker, sep, push = name.rpartition("#")
    if not sep or not push.lstrip("-").isdigit():
        return None
    return worker, int(push)


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


__all__ = ["Ballot", "Decisions", "Held", "Resolution", "SyncStep", "parse_push_name", "push_name"]
