"""K-batch-sync SGD (Dutta et al., AISTATS 2018, "Slow and Stale Gradients Can Win the Race",
the K-batch-sync variant of §2): each step is the average of the first K mini-batch gradients
computed from the current version, from any workers, several possibly from one.

Every worker computes at the same values; a worker that pushed does not wait: it reads (the same
values while the step is not made) and computes the next mini-batch. Once K gradients are in,
the step is made and every worker still computing is interrupted: its gradient, computed from
the previous version, is dropped as late and it reads the new values. K-sync (K of the workers,
one gradient each) is `sync:backup=n-K`.

Registered as `k-batch-sync:k=K` in asyncps.rules.modes.MODES; on shards other than 0 a
SyncFollower applies exactly the pushes shard 0 decided and drops the rest of each step.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncps.rules.consistency import Admission, Verdict, check_count
from asyncps.rules.drops import DropReason
from asyncps.rules.registry import param
from asyncps.rules.sync.coordinated import ArrivalCoordinator, CoordinatedMode, Coordinator
from asyncps.rules.sync.follower import FollowRule
from asyncps.rules.sync.types import Ballot


class KBatchSyncConsistency(ArrivalCoordinator):
    """K-batch-sync: a step is the first K mini-batches computed from the current version."""

    name = "k-batch-sync"

    def admit(self, worker_id: str, base_version: int, version: int, ballot: Ballot | None = None) -> Admission:
        """Accumulate a gradient of the current version; one from an earlier version was interrupted (late)."""
        if base_version < version:
            return Admission(Verdict.DROP, f"late: version {base_version} already applied", DropReason.LATE)
        self.admitted(worker_id, base_version, version, ballot)
        return Admission(Verdict.ACCUMULATE)

    def need(self) -> int:
        """K mini-batches, from whichever workers."""
        return self.k

    def readable(self, worker_id: str, base_version: int, version: int) -> bool:
        """Never waits: the next mini-batch is computed at the values of the step not made yet."""
        return True


@dataclass(frozen=True)
class KBatchSyncMode(CoordinatedMode):
    """K-batch-sync (Dutta et al. 2018): each version averages the first K mini-batches computed from the last one."""

    k: int = param(1, help="mini-batch gradients (from any workers) that make a step")

    def __post_init__(self) -> None:
        check_count("k", self.k, minimum=1)

    def coordinator(self, num_workers: int) -> Coordinator:
        """The first-K-mini-batches rule."""
        return KBatchSyncConsistency(num_workers, self.k)

    def follow_rule(self) -> FollowRule:
        """Sets of pushes; a step retires the gradients of it and earlier steps it did not take."""
        return FollowRule(by_push=True, retire_late=True)


__all__ = ["KBatchSyncConsistency", "KBatchSyncMode"]
