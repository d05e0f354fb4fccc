"""A staleness-policy plugin that lives outside asyncps: spec `byo_plugins:IgnoreWorker[:worker=N]`.

It drops every push of one worker and applies every other, which shows that a plugin sees who
pushed (and the worker's step and the staleness), and that the shards load it by name: the spec
travels to them and each imports this module (it must be on their Python path: --user-path).
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncps.rules.drops import DropReason
from asyncps.rules.policies import Decision, PushContext, StalenessPolicy
from asyncps.rules.registry import param


@dataclass(frozen=True)
class IgnoreWorker(StalenessPolicy):
    """Drops every push of worker `worker`; applies the others as plain async SGD."""

    worker: int = param(1, help="index of the worker whose pushes are dropped")

    def decide(self, staleness: int) -> Decision:
        """Without knowing the worker: apply."""
        return Decision(True)

    def decide_push(self, push: PushContext) -> Decision:
        """Drop the pushes of the ignored worker, whatever their staleness or step."""
        if push.worker_index == self.worker:
            return Decision(False, reason=f"worker {self.worker} is ignored (step {push.step}, staleness "
                                          f"{push.staleness})", drop=DropReason.STALE)
        return Decision(True)
