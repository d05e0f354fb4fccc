"""The interface of a coordinated mode: shard 0 decides each step's set of pushes for all shards.

A coordinated mode (sync; the K-variants) is a `CoordinatedMode` spec whose `coordinator` is the
mode's own rule on shard 0, a `Coordinator` that records each step's set; every other shard runs
the same `SyncFollower` (asyncps.rules.sync.follower), which applies exactly the decided sets,
read by the mode's `follow_rule` (sets of workers of one step, or of named pushes). A new
coordinated mode writes its coordinator and its spec only; `ArrivalCoordinator` is the common
part of the modes whose step is the first K pushes admitted (the K-variants).
"""

from __future__ import annotations

import abc
import collections
from collections.abc import Mapping

from asyncps.rules.consistency import Consistency, ModeSpec, ShardHandle
from asyncps.rules.sync.follower import SYNC_RULE, FollowRule, SyncFollower
from asyncps.rules.sync.steps import DECISION_LOG, PendingStep
from asyncps.rules.sync.types import Ballot, Decisions, SyncStep, push_name
from asyncps.wire.codec import Gradient


class Coordinator(Consistency):
    """A coordinated mode's rule on shard 0: it decides steps and remembers each step's set.

    A subclass calls `decide` when a step is made; the shard answers its `decisions` to workers
    (with every reply) and to the chief's cut (`hold`, the default's)."""

    state_types = (PendingStep,)  # a subclass's accumulated step

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

    def decisions(self, shard: ShardHandle, since: int) -> Decisions | None:
        """The decided sets of the steps >= since, under this shard's incarnation (None: none)."""
        steps = self.decisions_since(since)
        return Decisions(shard.incarnation, steps) if steps else None


class ArrivalCoordinator(Coordinator):
    """A coordinator whose step is the average of the first `need()` pushes it admitted (the
    K-variants, Dutta et al. 2018); its decided sets name those pushes (FollowRule.by_push).

    A subclass says which pushes it admits (`admit`), how many make a step (`need`) and when a
    worker may read (`readable`). Every admitted push is in the next step, so a push's staleness
    when applied is the one the shard answers at push time. Stats: steps made, the largest
    staleness and the most pushes of one worker in a step."""

    exclusive = True

    def __init__(self, num_workers: int, k: int) -> None:
        super().__init__(num_workers)
        self.k = k
        self._pending = PendingStep()
        self._pushes: list[tuple[str, int]] = []  # the step's pushes so far: (worker, its step)
        self._arrivals = 0  # names pushes that carry no worker step (one shard: no follower reads them)
        self._admitted: tuple[str, int, int] = ("", 0, 0)  # worker, base version, push: for accumulate
        self._version = 0  # the coordinator version the pending step will make + 1
        self.steps_made = 0
        self.max_staleness = 0
        self.max_pushes_per_worker = 0

    def admitted(self, worker_id: str, base_version: int, version: int, ballot: Ballot | None) -> None:
        """Remember an admitted push (call from `admit` before answering ACCUMULATE)."""
        self._arrivals += 1
        push = ballot.push if ballot is not None and ballot.push is not None else -self._arrivals
        self._admitted = (worker_id, base_version, push)
        self._version = version
        self.max_staleness = max(self.max_staleness, version - base_version)

    def pending_workers(self) -> set[str]:
        """The workers with a push in the pending step."""
        return {worker for worker, _ in self._pushes}

    def accumulate(self, worker_id: str, grads: Mapping[str, Gradient], ballot: Ballot | None = None) -> None:
        """Add an admitted push to the pending step."""
        self._pending.add(grads)
        self._pushes.append((worker_id, self._admitted[2]))

    @abc.abstractmethod
    def need(self) -> int:
        """How many pushes make a step now."""

    def take_step(self) -> dict[str, Gradient] | None:
        """The average of the pending pushes once there are need() of them; the set is decided."""
        if self._pending.count == 0 or self._pending.count < self.need():
            return None
        step = self._pending.average()
        self.decide(self._version, frozenset(push_name(w, p) for w, p in self._pushes))
        per_worker = collections.Counter(w for w, _ in self._pushes)
        self.max_pushes_per_worker = max(self.max_pushes_per_worker, max(per_worker.values()))
        self._pending = PendingStep()
        self._pushes = []
        self.steps_made += 1
        return step

    def stats(self) -> dict[str, float]:
        """Steps made, the largest staleness admitted, the most pushes of one worker in a step."""
        return {"k": float(self.k), "k_steps": float(self.steps_made), "k_max_staleness": float(self.max_staleness),
                "k_max_pushes_per_worker": float(self.max_pushes_per_worker)}


class CoordinatedMode(ModeSpec):
    """A mode whose steps shard 0 decides for every shard: its coordinator there, followers elsewhere."""

    @property
    def coordinated(self) -> bool:
        """Shard 0 decides each step for every shard."""
        return True

    @abc.abstractmethod
    def coordinator(self, num_workers: int) -> Coordinator:
        """The mode's rule on shard 0, for a run planned with num_workers."""

    def follow_rule(self) -> FollowRule:
        """How the followers read this mode's decided sets (sync's: workers of one step)."""
        return SYNC_RULE

    def start(self, num_workers: int, shard_index: int = 0) -> Consistency:
        """The coordinator on shard 0, a SyncFollower on the others."""
        if shard_index == 0:
            return self.coordinator(num_workers)
        return SyncFollower(num_workers, self.follow_rule())


__all__ = ["ArrivalCoordinator", "CoordinatedMode", "Coordinator"]
