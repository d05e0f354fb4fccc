"""Bulk-synchronous SGD over one or several shards: the coordinator's quorum rule and the `sync` spec.

Registered as `sync` in asyncps.rules.modes.MODES; on shards other than 0 it runs a SyncFollower.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from asyncps.rules.consistency import Admission, Verdict, check_count
from asyncps.rules.drops import DropReason
from asyncps.rules.registry import param
from asyncps.rules.sync.coordinated import CoordinatedMode, Coordinator
from asyncps.rules.sync.steps import PendingStep
from asyncps.rules.sync.types import Ballot
from asyncps.wire.codec import Gradient


class SyncConsistency(Coordinator):
    """Bulk-synchronous: version v+1 is the average of the first quorum gradients computed from v.

    With b backup workers the quorum is (live workers - b) (Chen et al. 2016, "Revisiting
    Distributed Synchronous SGD"): gradients arriving after their version was applied are
    dropped as late. The quorum follows the chief's live set, so a dead worker cannot stall
    training and a joining one is waited for. On shard 0 it is also the coordinator of the other
    shards: it remembers which workers each step averaged (Coordinator, see SyncFollower).
    """

    name = "sync"
    exclusive = True

    def __init__(self, num_workers: int, backup_workers: int) -> None:
        super().__init__(num_workers)
        self.backup_workers = backup_workers
        self.contributors: set[str] = set()
        self._pending = PendingStep()
        self._pending_version = 0

    def admit(self, worker_id: str, base_version: int, version: int, ballot: Ballot | None = None) -> Admission:
        """Accumulate a gradient for the current version; drop late or duplicate ones."""
        if base_version < version:
            return Admission(Verdict.DROP, f"late: version {base_version} already applied", DropReason.LATE)
        if worker_id in self.contributors:
            return Admission(Verdict.DROP, f"duplicate: {worker_id} already pushed for version {version}",
                             DropReason.DUPLICATE)
        self.contributors.add(worker_id)
        self._pending_version = version
        return Admission(Verdict.ACCUMULATE)

    def accumulate(self, worker_id: str, grads: Mapping[str, Gradient], ballot: Ballot | None = None) -> None:
        """Add an admitted gradient to the current step's sums."""
        self._pending.add(grads)

    def quorum(self) -> int:
        """Live workers minus backups, at least one."""
        live = self.num_workers if self.live is None else len(self.live)
        return max(1, live - self.backup_workers)

    def take_step(self) -> dict[str, Gradient] | None:
        """The average of the step's gradients once the quorum is reached; the next version then
        starts with no gradients and no contributors."""
        if self._pending.count == 0 or self._pending.count < self.quorum():
            return None
        step = self._pending.average()
        self.decide(self._pending_version, frozenset(self.contributors))
        self._pending = PendingStep()
        self.contributors.clear()
        return step

    def readable(self, worker_id: str, base_version: int, version: int) -> bool:
        """A worker waits for the step its gradient belongs to."""
        return version > base_version


@dataclass(frozen=True)
class SyncMode(CoordinatedMode):
    """Bulk-synchronous: each version is the average of the first (live workers - backup) gradients."""

    backup: int = param(0, help="backup workers: later gradients of a step are dropped as late")

    def __post_init__(self) -> None:
        check_count("backup", self.backup)

    def coordinator(self, num_workers: int) -> Coordinator:
        """The quorum rule with this many backup workers."""
        return SyncConsistency(num_workers, self.backup)


__all__ = ["SyncConsistency", "SyncMode"]
