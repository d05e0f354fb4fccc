"""Outer rules of local SGD: how a shard applies a worker's model delta, and how the worker follows.

With `--local-steps H` (H > 1) a worker takes H steps of its own optimizer on its own copy of the
model, then pushes the pseudo-gradient `delta = w_pulled - w_local` (the change of its model, sign
as a gradient's) with the versions of `w_pulled`. The shard applies deltas with its ordinary
optimizer machinery, so the outer rule is the optimizer it names here:

- `average`: outer SGD with lr 1. In sync mode the shard averages the n pushes of a step, so the
  center becomes the mean of the local models (periodic model averaging, Stich 2019; Lin et al.
  2020); in async mode each delta is added as it arrives.
- `easgd:alpha=A`: elastic averaging (Zhang, Choromanska & LeCun 2015): the center moves by
  `A * (w_local - w_pulled)` (outer SGD with lr A), and the worker does not take the center: it
  moves its own model toward the center it pulled, `w_local -= A * (w_local - w_pulled)`.
- `nesterov:lr=LR,momentum=M`: an outer SGD with Nesterov momentum (DiLoCo, Douillard et al. 2023:
  lr 0.7, momentum 0.9).
- `delayed-nesterov:lr=LR,momentum=M,period=N`: for async local SGD (Liu et al. 2024, "Asynchronous
  Local-SGD Training for Language Modeling"): each delta moves the center by lr/N of itself at once,
  the momentum steps once per N deltas with their mean (N: the number of workers). Without
  staleness N async deltas land where one sync Nesterov step of their mean does; plain `nesterov`
  in async applies the momentum to every stale delta.

Staleness is counted in outer versions (the shard's version rises by one per applied delta).
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass

from asyncps.rules.optimizers import OptimizerConfig, _check_hyperparameter
from asyncps.rules.registry import Registry, param


class OuterRule(abc.ABC):
    """What a shard applies to the deltas of local SGD, and how a worker follows the center."""

    @abc.abstractmethod
    def shard_optimizer(self) -> OptimizerConfig:
        """The optimizer the shards apply to the deltas."""

    def elastic_pull(self) -> float:
        """How far a worker moves its own model toward the pulled center after a push (0: none,
        it takes the center)."""
        return 0.0


OUTER_RULES: Registry[OuterRule] = Registry("outer rule", OuterRule, group="asyncps.outer_rules")


@OUTER_RULES.register("average")
@dataclass(frozen=True)
class Average(OuterRule):
    """Model averaging: the center takes the deltas with lr 1 (sync: the mean of the local models)."""

    def shard_optimizer(self) -> OptimizerConfig:
        """SGD with lr 1: the center moves by the (averaged) change of the local models."""
        return OptimizerConfig("sgd", 1.0)


@OUTER_RULES.register("easgd")
@dataclass(frozen=True)
class ElasticAveraging(OuterRule):
    """EASGD: center += alpha (local - center); each worker's model moves toward it by as much."""

    alpha: float = param(0.5, help="moving rate of the center and of each worker's elastic pull, in (0, 1]")

    def __post_init__(self) -> None:
        alpha = self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha) \
                or not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        object.__setattr__(self, "alpha", float(alpha))

    def shard_optimizer(self) -> OptimizerConfig:
        """SGD with lr alpha on the center."""
        return OptimizerConfig("sgd", self.alpha)

    def elastic_pull(self) -> float:
        """alpha: the worker's model moves by alpha toward the center it pulled."""
        return self.alpha


@OUTER_RULES.register("nesterov")
@dataclass(frozen=True)
class NesterovOuter(OuterRule):
    """Outer SGD with Nesterov momentum on the deltas (DiLoCo)."""

    lr: float = param(0.7, help="outer learning rate, > 0")
    momentum: float = param(0.9, help="outer momentum, in [0, 1]")

    def __post_init__(self) -> None:
        object.__setattr__(self, "momentum", _check_hyperparameter("momentum", self.momentum))
        OptimizerConfig("nesterov", self.lr)  # lr > 0 and finite, else a ValueError saying so

    def shard_optimizer(self) -> OptimizerConfig:
        """keras' SGD(lr, momentum, nesterov=True) on the deltas."""
        return OptimizerConfig("nesterov", self.lr, {"momentum": self.momentum})


@OUTER_RULES.register("delayed-nesterov")
@dataclass(frozen=True)
class DelayedNesterovOuter(OuterRule):
    """Outer Nesterov whose momentum steps once per `period` deltas (Liu et al. 2024)."""

    lr: float = param(0.7, help="outer learning rate, > 0")
    momentum: float = param(0.9, help="outer momentum, in [0, 1]")
    period: int = param(2, help="deltas per momentum step: the number of workers, >= 1")

    def __post_init__(self) -> None:
        self.shard_optimizer()  # every value checked: a ValueError saying which is wrong

    def shard_optimizer(self) -> OptimizerConfig:
        """asyncps.rules.optimizers.DelayedNesterov on the deltas."""
        return OptimizerConfig("delayed-nesterov", self.lr, {"momentum": self.momentum, "period": self.period})


@dataclass(frozen=True)
class LocalRule:
    """A run's local SGD: H local steps of the workers' optimizer per push, and the outer rule."""

    steps: int
    optimizer: OptimizerConfig  # the workers' optimizer of local steps
    outer: OuterRule
