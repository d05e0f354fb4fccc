"""K-async SGD (Dutta et al., AISTATS 2018, "Slow and Stale Gradients Can Win the Race", the
K-async variant of §2): each step is the average of the first K gradients from K distinct
workers, whatever version each was computed from (so they may be stale).

A worker that pushed waits until the step that includes its gradient is made, then reads the
new values and computes again; the workers not in that step are not interrupted: they keep
computing at the values they read and their gradients go into a later step, stale. K = 1 is
fully asynchronous SGD; K = number of workers waits for every worker, with stale gradients.

Registered as `k-async:k=K` in asyncps.rules.modes.MODES; on shards other than 0 a SyncFollower
applies exactly the pushes shard 0 decided, staged gradients waiting for a later step.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncps.rules.consistency import Admission, Verdict, check_count
from asyncps.rules.drops import DropReason
from asyncps.rules.registry import param
from asyncps.rules.sync.coordinated import ArrivalCoordinator, CoordinatedMode, Coordinator
from asyncps.rules.sync.follower import FollowRule
from asyncps.rules.sync.types import Ballot


class KAsyncConsistency(ArrivalCoordinator):
    """K-async: a step is the first K pushes of distinct workers, stale ones included."""

    name = "k-async"

    def admit(self, worker_id: str, base_version: int, version: int, ballot: Ballot | None = None) -> Admission:
        """Accumulate any gradient, stale or not; a second one of a worker in the step is a duplicate."""
        if worker_id in self.pending_workers():
            return Admission(Verdict.DROP, f"duplicate: {worker_id} already has a gradient in step {version}",
                             DropReason.DUPLICATE)
        self.admitted(worker_id, base_version, version, ballot)
        return Admission(Verdict.ACCUMULATE)

    def need(self) -> int:
        """K distinct workers, or every live worker when fewer are alive (a dead one cannot stall)."""
        live = self.num_workers if self.live is None else len(self.live)
        return max(1, min(self.k, live))

    def readable(self, worker_id: str, base_version: int, version: int) -> bool:
        """A worker waits until the step with its gradient is made (then it gets the new values)."""
        return worker_id not in self.pending_workers()


@dataclass(frozen=True)
class KAsyncMode(CoordinatedMode):
    """K-async (Dutta et al. 2018): each version averages the first K gradients of distinct workers, stale ones too."""

    k: int = param(1, help="distinct workers whose gradients make a step")

    def __post_init__(self) -> None:
        check_count("k", self.k, minimum=1)

    def coordinator(self, num_workers: int) -> Coordinator:
        """The first-K-distinct rule."""
        return KAsyncConsistency(num_workers, self.k)

    def follow_rule(self) -> FollowRule:
        """Sets of pushes; a gradient not taken waits for a later step."""
        return FollowRule(by_push=True, retire_late=False)


__all__ = ["KAsyncConsistency", "KAsyncMode"]
