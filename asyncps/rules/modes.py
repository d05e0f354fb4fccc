"""Consistency models of a shard: when gradients become updates and when a worker may read again.

One small class per model, chosen by the update rule's `mode`; the store asks it three things
and never branches on the mode:
- `admit`: apply a gradient now, accumulate it for a synchronous step, or drop it (and why);
- `quorum`: how many accumulated gradients make a synchronous step;
- `readable`: whether a worker that just pushed may receive parameters and start its next step.

All methods run with the store's state lock held.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from asyncps.rules.drops import DropReason


class Verdict(Enum):
    """What the store does with an admitted gradient."""

    APPLY = "apply"
    ACCUMULATE = "accumulate"
    DROP = "drop"


@dataclass(frozen=True)
class Admission:
    """A verdict and, for drops, the reason."""

    verdict: Verdict
    reason: str = ""
    drop: DropReason | None = None  # the kind of a DROP verdict


class Consistency(abc.ABC):
    """A consistency model: BSP (sync), SSP or fully asynchronous."""

    name: str
    exclusive = False  # True: a push needs every variable lock (it may complete a step)

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.live: set[str] | None = None  # None until the chief first says who is alive

    @abc.abstractmethod
    def admit(self, worker_id: str, base_version: int, version: int) -> Admission:
        """Decide what to do with a gradient from `worker_id` computed from `base_version`."""

    def pushed(self, worker_id: str) -> None:  # noqa: B027 - a hook; most models need nothing
        """A push from worker_id was handled (applied, accumulated or dropped)."""

    def applied(self) -> None:  # noqa: B027 - a hook; only synchronous models keep per-step state
        """An accumulated (synchronous) step was applied."""

    def readable(self, worker_id: str, base_version: int, version: int) -> bool:
        """May worker_id, whose last gradient was computed from base_version, read now?"""
        return True

    def quorum(self) -> int:
        """How many gradients make one synchronous update (unused by asynchronous models)."""
        return 1

    def set_live(self, workers: Iterable[str]) -> None:
        """The chief's current set of live workers."""
        self.live = set(workers)

    def stats(self) -> dict[str, float]:
        """Model-specific counters for ShardStats."""
        return {}


class AsyncConsistency(Consistency):
    """Fully asynchronous: every gradient is applied as soon as it arrives (Hogwild-style PS)."""

    name = "async"

    def admit(self, worker_id: str, base_version: int, version: int) -> Admission:
        """Always apply (the staleness policy may still drop or scale it)."""
        return Admission(Verdict.APPLY)


class SyncConsistency(Consistency):
    """Bulk-synchronous: version v+1 is the average of the first quorum gradients computed from v.

    With b backup workers the quorum is (live workers - b) (Chen et al. 2016, "Revisiting
    Distributed Synchronous SGD"): gradients arriving after their version was applied are
    dropped as late. The quorum follows the chief's live set, so a dead worker cannot stall
    training and a joining one is waited for.
    """

    name = "sync"
    exclusive = True

    def __init__(self, num_workers: int, backup_workers: int) -> None:
        super().__init__(num_workers)
        self.backup_workers = backup_workers
        self.contributors: set[str] = set()

    def admit(self, worker_id: str, base_version: int, version: int) -> Admission:
        """Accumulate a gradient for the current version; drop late or duplicate ones."""
        if base_version < version:
            return Admission(Verdict.DROP, f"late: version {base_version} already applied", DropReason.LATE)
        if worker_id in self.contributors:
            return Admission(Verdict.DROP, f"duplicate: {worker_id} already pushed for version {version}",
                             DropReason.DUPLICATE)
        self.contributors.add(worker_id)
        return Admission(Verdict.ACCUMULATE)

    def quorum(self) -> int:
        """Live workers minus backups, at least one."""
        live = self.num_workers if self.live is None else len(self.live)
        return max(1, live - self.backup_workers)

    def applied(self) -> None:
        """A synchronous step completed: the next version starts with no contributors."""
        self.contributors.clear()

    def readable(self, worker_id: str, base_version: int, version: int) -> bool:
        """A worker waits for the step its gradient belongs to."""
        return version > base_version


class SSPConsistency(Consistency):
    """Stale Synchronous Parallel (Ho et al. 2013): updates apply at once, but a worker whose
    clock (pushes so far) leads the slowest live worker's by more than s must wait."""

    name = "ssp"

    def __init__(self, num_workers: int, staleness_bound: int) -> None:
        super().__init__(num_workers)
        self.bound = staleness_bound
        self.clocks: dict[str, int] = {}
        self.max_lead = 0

    def admit(self, worker_id: str, base_version: int, version: int) -> Admission:
        """Apply at once (asynchronous updates, bounded clocks)."""
        return Admission(Verdict.APPLY)

    def pushed(self, worker_id: str) -> None:
        """Advance the worker's clock; a worker the model has not seen joins at the slowest clock."""
        if worker_id not in self.clocks:
            self.clocks[worker_id] = self._min_clock()
        self.clocks[worker_id] += 1

    def _min_clock(self) -> int:
        if self.live is None:
            clocks = list(self.clocks.values())
            if len(clocks) < self.num_workers:
                clocks.append(0)  # planned workers not seen yet are at clock 0
            return min(clocks, default=0)
        return min((self.clocks[w] for w in self.live if w in self.clocks), default=0)

    def lead(self, worker_id: str) -> int:
        """How far worker_id's clock is ahead of the slowest live worker."""
        return self.clocks.get(worker_id, 0) - self._min_clock()

    def readable(self, worker_id: str, base_version: int, version: int) -> bool:
        """Start the next clock only while the lead is within the bound."""
        lead = self.lead(worker_id)
        if lead <= self.bound:
            self.max_lead = max(self.max_lead, lead)
            return True
        return False

    def set_live(self, workers: Iterable[str]) -> None:
        """Dead workers no longer hold the others back; new ones start at the slowest live clock.

        Workers named in the first live set are the run's initial workers and start at 0.
        """
        first = self.live is None
        joining = set(workers) - self.clocks.keys()
        frontier = 0 if first else self._min_clock()
        super().set_live(workers)
        for worker in joining:
            self.clocks[worker] = frontier

    def stats(self) -> dict[str, float]:
        """The largest lead with which any worker started a step."""
        return {"max_clock_lead": float(self.max_lead)}


MODES = ("async", "sync", "ssp")


def make_consistency(mode: str, num_workers: int, backup_workers: int, staleness_bound: int) -> Consistency:
    """Build the consistency model named by `mode`."""
    if mode == "async":
        return AsyncConsistency(num_workers)
    if mode == "sync":
        return SyncConsistency(num_workers, backup_workers)
    if mode == "ssp":
        return SSPConsistency(num_workers, staleness_bound)
    raise ValueError(f"unknown mode {mode!r}; valid: {', '.join(MODES)}")
