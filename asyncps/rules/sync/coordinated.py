"""The interface of a coordinated mode: shard 0 decides each step's set of pushes for all shards.

A coordinated mode (sync today; the K-variants next) is a `CoordinatedMode` spec whose
`coordinator` is the mode's own rule on shard 0, a `Coordinator` that records each step's set;
every other shard runs the same `SyncFollower` (asyncps.rules.sync.follower), which applies
exactly the decided sets. A new coordinated mode writes its coordinator and its spec only.
"""

from __future__ import annotations

import abc
import collections

from asyncps.rules.consistency import Consistency, ModeSpec
from asyncps.rules.sync.follower import SyncFollower
from asyncps.rules.sync.steps import DECISION_LOG
from asyncps.rules.sync.types import SyncStep


class Coordinator(Consistency):
    """A coordinated mode's rule on shard 0: it decides steps and remembers each step's set.

    A subclass calls `decide` when a step is made; the shard answers `decisions_since` to workers
    (with every reply) and to the chief's cut."""

    def __init__(self, num_workers: int) -> None:
        super().__init__(num_workers)
        self._decided: collections.OrderedDict[int, frozenset[str]] = collections.OrderedDict()

    def decide(self, step: int, workers: frozenset[str]) -> None:
        """Record that coordinator version `step` + 1 is made of exactly `workers`' gradients."""
        self._decided[step] = workers
        while len(self._decided) > DECISION_LOG:
            self._decided.popitem(last=False)

    def decisions_since(self, step: int) -> tuple[SyncStep, ...]:
        """The decided sets of the steps >= step still remembered, oldest first."""
        if step < 0 or not self._decided or step > next(reversed(self._decided)):
            return ()
        return tuple(SyncStep(s, workers) for s, workers in self._decided.items() if s >= step)


class CoordinatedMode(ModeSpec):
    """A mode whose steps shard 0 decides for every shard: its coordinator there, followers elsewhere."""

    @property
    def coordinated(self) -> bool:
        """Shard 0 decides each step for every shard."""
        return True

    @abc.abstractmethod
    def coordinator(self, num_workers: int) -> Coordinator:
        """The mode's rule on shard 0, for a run planned with num_workers."""

    def start(self, num_workers: int, shard_index: int = 0) -> Consistency:
        """The coordinator on shard 0, a SyncFollower on the others."""
        if shard_index == 0:
            return self.coordinator(num_workers)
        return SyncFollower(num_workers)


__all__ = ["CoordinatedMode", "Coordinator"]
