"""Update-rule plugins that live outside asyncps, one of each kind.

- `--staleness-policy byo_plugins:IgnoreWorker[:worker=N]` drops every push of one worker and
  applies every other: a plugin sees who pushed (and the worker's step and the staleness).
- `--optimizer byo_plugins:SignSGD`: value -= lr * sign(gradient).
- `--mode byo_plugins:FirstWins`: each version is the first gradient computed from the previous one.

The shards load them by name: the spec travels to them and each imports this module, so it must
be on their Python path (--user-path) and allowed by their `--plugins byo_plugins` (a shard never
imports a module only because a request names it; `asyncps local` passes the flag itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from asyncps.rules.drops import DropReason
from asyncps.rules.modes import Consistency, ModeSpec
from asyncps.rules.optimizers import Optimizer
from asyncps.rules.policies import Decision, PushContext, StalenessPolicy
from asyncps.rules.registry import param
from asyncps.rules.sync.bsp import SyncConsistency


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


@dataclass(frozen=True)
class SignSGD(Optimizer):
    """signSGD (Bernstein et al. 2018): every element moves by lr against the sign of its gradient."""

    def _apply(self, value: np.ndarray, grad: np.ndarray, slots: dict[str, np.ndarray], lr: np.float32,
               step: int) -> None:
        value -= lr * np.sign(grad)


@dataclass(frozen=True)
class FirstWins(ModeSpec):
    """Synchronous steps of one gradient: the first computed from a version makes the next one."""

    def start(self, num_workers: int, shard_index: int = 0) -> Consistency:
        """Sync with every worker but one a backup: the rest of a step arrives late and is dropped.

        Each shard decides on its own here (a one-shard example): the built-in sync mode shows how
        shard 0 decides for all of them (asyncps.rules.sync)."""
        return SyncConsistency(num_workers, num_workers - 1)
