"""A worker's own model for local SGD: H steps of its optimizer, the delta it pushes, how it follows.

The worker keeps its own copy of the model and its optimizer's state (kept across rounds, as
DiLoCo keeps its inner AdamW state). A round starts from the center it pulled, w_pulled; after H
local steps it pushes delta = w_pulled - w_local, computed from the versions of w_pulled. After
the push it takes the new center (average, nesterov), or, for EASGD, moves its own model toward
the center it pulled: w_local -= alpha * (w_local - w_pulled), i.e. w_local += alpha * delta.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from asyncps.config import RunConfig
from asyncps.rules.optimizers import Optimizer, Slots, make_optimizer
from asyncps.rules.outer import LocalRule
from asyncps.wire.codec import Array, Gradient, SparseRows, aligned_zeros


class LocalModel:
    """One worker's local model and optimizer state over the rounds of local SGD (one thread)."""

    def __init__(self, rule: LocalRule, names: Sequence[str]) -> None:
        self.rule = rule
        self._names = list(names)
        self._optimizer: Optimizer = make_optimizer(rule.optimizer)
        self._elastic = rule.outer.elastic_pull()
        self.values: list[Array] = []  # the local model, in `names` order (empty until `start`)
        self._slots: list[Slots] = []
        self._steps = 0  # local steps taken so far (the optimizer's 1-based step count)

    @property
    def steps_per_push(self) -> int:
        """H: local steps per push."""
        return self.rule.steps

    def start(self, center: Mapping[str, Array]) -> None:
        """Take the pulled center as the local model (the first round, or after a discarded round)."""
        self.values = [aligned_zeros(center[n].shape, np.float32) for n in self._names]  # computed from in place
        for value, n in zip(self.values, self._names, strict=True):
            np.copyto(value, center[n], casting="same_kind")
        if not self._slots:
            self._slots = [self._optimizer.init_slots(v) for v in self.values]

    def step(self, grads: Sequence[Gradient]) -> None:
        """One local step of the worker's optimizer on the local model."""
        lr = self.rule.optimizer.rate_at(self._steps)
        self._steps += 1
        for value, grad, slots in zip(self.values, grads, self._slots, strict=True):
            if isinstance(grad, SparseRows):
                self._optimizer.apply_sparse(value, grad.indices, grad.values, slots, lr, self._steps)
            else:
                self._optimizer.apply_dense(value, grad, slots, lr, self._steps)

    def delta(self, center: Mapping[str, Array]) -> list[Gradient]:
        """What the round pushes: w_pulled - w_local per variable (a new array each)."""
        return [np.subtract(center[n], v, dtype=np.float32) for n, v in zip(self._names, self.values, strict=True)]

    def follow(self, center: Mapping[str, Array], delta: Sequence[Gradient] | None) -> None:
        """After a push: take the new center, or (EASGD, `delta` pushed) pull the local model toward
        the center the round started from by alpha. `delta` None: the round was not pushed (a
        non-finite step), so the local model restarts from the center."""
        if self._elastic == 0 or delta is None:
            self.start(center)
            return
        alpha = np.float32(self._elastic)
        for value, d in zip(self.values, delta, strict=True):
            value += alpha * np.asarray(d)


def local_model(run: RunConfig, names: Sequence[str]) -> LocalModel | None:
    """A worker's local model for the run's local SGD (None: the run pushes every gradient)."""
    rule = run.local_rule()
    return None if rule is None else LocalModel(rule, names)
