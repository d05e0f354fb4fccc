"""K-batch-async SGD (Dutta et al., AISTATS 2018, "Slow and Stale Gradients Can Win the Race",
the K-batch-async variant of §2): each step is the average of the first K mini-batch gradients
to arrive, from any workers (several possibly from one) and whatever version each was computed
from.

No worker ever waits: after a push it reads the current values (new or not) and computes the
next mini-batch, so its gradients may be stale. K = 1 is fully asynchronous SGD.

Registered as `k-batch-async:k=K` in asyncps.rules.modes.MODES; on shards other than 0 a
SyncFollower applies exactly the pushes shard 0 decided, staged gradients waiting for a later step.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncps.rules.consistency import Admission, Verdict, check_count
from asyncps.rules.registry import param
from asyncps.rules.sync.coordinated import ArrivalCoordinator, CoordinatedMode, Coordinator
from asyncps.rules.sync.follower import FollowRule
from asyncps.rules.sync.types import Ballot


class KBatchAsyncConsistency(ArrivalCoordinator):
    """K-batch-async: a step is the first K pushes to arrive, stale ones and several of one worker included."""

    name = "k-batch-async"

    def admit(self, worker_id: str, base_version: int, version: int, ballot: Ballot | None = None) -> Admission:
        """Accumulate every gradient."""
        self.admitted(worker_id, base_version, version, ballot)
        return Admission(Verdict.ACCUMULATE)

    def need(self) -> int:
        """K mini-batches, from whichever workers."""
        return self.k

    def readable(self, worker_id: str, base_version: int, version: int) -> bool:
        """Never waits."""
        return True


@dataclass(frozen=True)
class KBatchAsyncMode(CoordinatedMode):
    """K-batch-async (Dutta et al. 2018): each version averages the first K gradients to arrive, stale ones too."""

    k: int = param(1, help="mini-batch gradients (from any workers, any version) that make a step")

    def __post_init__(self) -> None:
        check_count("k", self.k, minimum=1)

    def coordinator(self, num_workers: int) -> Coordinator:
        """The first-K-arrivals rule."""
        return KBatchAsyncConsistency(num_workers, self.k)

    def follow_rule(self) -> FollowRule:
        """Sets of pushes; a gradient not taken waits for a later step."""
        return FollowRule(by_push=True, retire_late=False)


__all__ = ["KBatchAsyncConsistency", "KBatchAsyncMode"]
