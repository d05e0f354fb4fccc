"""Staleness policies: how a shard treats a gradient according to its staleness.

Each policy is a small frozen dataclass with one job and its typed parameters, registered in
`POLICIES` and chosen by a spec string (`drop:bound=4`, `dc-asgd:lambda=0.1`; see
asyncps.rules.registry for the form, plugins included); the store calls `decide_push` (which
by default asks `decide` with the staleness alone; and `adjust` where `needs_read_values`) and
never branches on the kind. Per-row policies (`row-drop:bound=4`, `row-lr-scale`: `per_row`) judge each
row of a sparse push by the updates that row received since it was read (`decide_rows`), instead of the
push by the shard's version.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from asyncps.identity import index_of
from asyncps.rules.drops import DropReason
from asyncps.rules.registry import Registry, param
from asyncps.wire.codec import Array


@dataclass(frozen=True)
class Decision:
    """What to do with one gradient: apply it (with the learning rate scaled) or drop it."""

    accept: bool
    lr_scale: float = 1.0
    reason: str = ""
    drop: DropReason | None = None  # the kind of a refusal


@dataclass(frozen=True)
class RowDecision:
    """What to do with each row of a push, judged by its own staleness: apply it (its learning rate
    scaled) or drop it."""

    keep: npt.NDArray[np.bool_]  # per row: applied
    scale: npt.NDArray[np.float64]  # per row: the learning rate's scale (of a row kept)


@dataclass(frozen=True)
class PushContext:
    """What a policy may know about one push: who pushed, the worker's step, its staleness."""

    worker_id: str  # the worker's worker id (one process incarnation)
    step: int  # the worker's own step counter (its clock)
    staleness: int  # shard version now - the version the gradient was computed from
    pushed_index: int | None = None  # the index the worker sent with its push (None: it sent none)

    @property
    def worker_index(self) -> int | None:
        """The worker's index: the one it pushed with, else the one its worker id carries (a worker
        started with an index); None when neither says (a worker of an earlier version)."""
        return self.pushed_index if self.pushed_index is not None else index_of(self.worker_id)


class StalenessPolicy(abc.ABC):
    """Decides, from a gradient's staleness, whether and how strongly to apply it.

    Policies that correct the gradient itself (DC-ASGD, gap-aware) set `needs_read_values`; the
    store then keeps, per worker, the values that worker read at its last two versions (a
    pipelined gradient is one exchange older than the last read) and calls `adjust`, with the
    values of the version the gradient was computed from, for every (dense, or the touched rows
    of a sparse) gradient before applying it.
    """

    needs_read_values: ClassVar[bool] = False
    per_row: ClassVar[bool] = False  # judges each row of a push (decide_rows), not the push

    @property
    def spec(self) -> str:
        """The canonical spec string; parse_policy(spec) rebuilds an equal policy."""
        return POLICIES.canonical(self)

    @abc.abstractmethod
    def decide(self, staleness: int) -> Decision:
        """The decision for one gradient with the given staleness (>= 0)."""

    def decide_push(self, push: PushContext) -> Decision:
        """The decision for one push; override to use the worker or its step, not only the staleness."""
        return self.decide(push.staleness)

    def decide_rows(self, staleness: npt.NDArray[np.int64]) -> RowDecision:
        """The decision for each row, given each row's staleness (>= 0); every row kept unless per_row."""
        return RowDecision(np.ones(staleness.shape, dtype=bool), np.ones(staleness.shape))

    def adjust(
        self, name: str, grad: Array, value_now: Array, value_read: Array, state: dict[str, Array]
    ) -> Array:
        """The gradient to apply, given the current values and those the worker read.

        All arrays have the gradient's shape (for sparse gradients: the touched rows). `state`
        is this policy's per-variable scratch space, owned by the store, for running averages.
        Must not modify grad, value_now or value_read in place.
        """
        return grad


POLICIES: Registry[StalenessPolicy] = Registry("staleness policy", StalenessPolicy, group="asyncps.policies")


@POLICIES.register("none")
@dataclass(frozen=True)
class ApplyAll(StalenessPolicy):
    """Plain asynchronous SGD: every gradient is applied as it is."""

    def decide(self, staleness: int) -> Decision:
        """Always apply at the full learning rate."""
        return Decision(True)


@POLICIES.register("drop")
@dataclass(frozen=True)
class DropAbove(StalenessPolicy):
    """Drop gradients whose staleness exceeds a bound."""

    bound: int = param(help="largest staleness still applied")

    def __post_init__(self) -> None:
        if isinstance(self.bound, bool) or not isinstance(self.bound, int) or self.bound < 0:
            raise ValueError(f"bound must be an integer >= 0, got {self.bound!r}")

    def decide(self, staleness: int) -> Decision:
        """Apply when staleness <= K, else drop with the reason."""
        if staleness > self.bound:
            return Decision(False, reason=f"staleness {staleness} > {self.bound}", drop=DropReason.STALE)
        return Decision(True)


@POLICIES.register("lr-scale")
@dataclass(frozen=True)
class LrScale(StalenessPolicy):
    """Staleness-aware learning rate alpha / max(1, tau) (Zhang et al. 2016)."""

    def decide(self, staleness: int) -> Decision:
        """Apply with the learning rate divided by max(1, staleness)."""
        return Decision(True, lr_scale=1.0 / max(1, staleness))


class _PerRow(StalenessPolicy):
    """Base of the policies that judge each row of a push by the updates it received since it was read.

    The shard asks `decide_rows` with each row's staleness: for the rows of a sparse gradient sent with
    the clocks they were read at, the updates each row received since (docs/architecture.md, "Tables read
    by rows"); every row of a dense gradient, or of a sparse one sent without clocks, has the push's
    staleness (every update since its read touched it), so those parts are kept or dropped whole, as the
    per-push policy would. The push is never dropped as a whole unless none of it is kept.
    """

    per_row: ClassVar[bool] = True

    def decide(self, staleness: int) -> Decision:
        """Apply the push: its rows and parts are judged one by one (decide_rows)."""
        return Decision(True)


@POLICIES.register("row-drop")
@dataclass(frozen=True)
class RowDrop(_PerRow):
    """Drop the rows whose own staleness exceeds a bound; apply the fresh ones."""

    bound: int = param(help="largest per-row staleness still applied")

    def __post_init__(self) -> None:
        if isinstance(self.bound, bool) or not isinstance(self.bound, int) or self.bound < 0:
            raise ValueError(f"bound must be an integer >= 0, got {self.bound!r}")

    def decide_rows(self, staleness: npt.NDArray[np.int64]) -> RowDecision:
        """Keep the rows with staleness <= K, at the full learning rate."""
        return RowDecision(staleness <= self.bound, np.ones(staleness.shape))


@POLICIES.register("row-lr-scale")
@dataclass(frozen=True)
class RowLrScale(_PerRow):
    """Each row's learning rate alpha / max(1, s), s the updates that row received since it was read."""

    def decide_rows(self, staleness: npt.NDArray[np.int64]) -> RowDecision:
        """Keep every row, its learning rate divided by max(1, its staleness) (lr-scale's rule, per row)."""
        return RowDecision(np.ones(staleness.shape, dtype=bool), 1.0 / np.maximum(1, staleness))


class _GradientCorrection(StalenessPolicy):
    """Base of the policies that correct a stale gradient instead of scaling or dropping it."""

    needs_read_values: ClassVar[bool] = True

    def decide(self, staleness: int) -> Decision:
        """Always apply at the full learning rate: `adjust` does the mitigation."""
        return Decision(True)


@POLICIES.register("dc-asgd")
@dataclass(frozen=True)
class DelayCompensated(_GradientCorrection):
    """DC-ASGD-c: g + lambda * g * g * (w_now - w_read).

    Zheng et al., "Asynchronous Stochastic Gradient Descent with Delay Compensation", ICML 2017:
    a first-order Taylor correction of the delayed gradient, with the Hessian approximated by
    lambda * g * g (the diagonal of the outer product, lambda the "variance control parameter").
    The default 0.04 is the value the paper runs DC-ASGD-c with, and MXNet's DCASGD default.
    """

    variance_control: float = param(0.04, key="lambda", help="variance control: the Hessian is lambda * g * g")

    def __post_init__(self) -> None:
        _check_finite("lambda", self.variance_control, minimum=0.0)

    def adjust(
        self, name: str, grad: Array, value_now: Array, value_read: Array, state: dict[str, Array]
    ) -> Array:
        """The delay-compensated gradient, in the gradient's dtype."""
        dtype = grad.dtype
        gap = _as(value_now, dtype) - _as(value_read, dtype)
        compensated: Array = grad + dtype.type(self.variance_control) * grad * grad * gap
        return compensated


@POLICIES.register("dc-asgd-a")
@dataclass(frozen=True)
class AdaptiveDelayCompensated(_GradientCorrection):
    """DC-ASGD-a: DC-ASGD with lambda_t = lambda0 / sqrt(mean_square_t + eps), elementwise.

    Zheng et al., ICML 2017, the adaptive variant: mean_square_t = m * mean_square_{t-1} +
    (1 - m) * g * g, updated with the current gradient before lambda_t is computed and starting
    from zero, as in the authors' Multiverso updater (which also fixes eps = 1e-7). Defaults are the
    paper's DC-ASGD-a setting: lambda0 = 2, m = 0.95. The running mean square lives in `state`,
    one per variable (the reference keeps one per worker; per variable matches the store's state).
    """

    variance_control: float = param(2.0, key="lambda0", help="lambda_t = lambda0 / sqrt(mean_square + eps)")
    momentum: float = param(0.95, help="decay m of the running mean square of the gradient")
    EPSILON: ClassVar[float] = 1e-7
    MEAN_SQUARE: ClassVar[str] = "mean_square"

    def __post_init__(self) -> None:
        _check_finite("lambda0", self.variance_control, minimum=0.0)
        _check_finite("momentum", self.momentum, minimum=0.0)
        if not self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum!r}")

    def adjust(
        self, name: str, grad: Array, value_now: Array, value_read: Array, state: dict[str, Array]
    ) -> Array:
        """The adaptively delay-compensated gradient; updates state["mean_square"]."""
        dtype = grad.dtype
        momentum = dtype.type(self.momentum)
        previous = state.get(self.MEAN_SQUARE)
        square = grad * grad
        if previous is None or previous.shape != grad.shape:
            # First call (or the rows changed shape): the recurrence starts from zero.
            mean_square = (dtype.type(1) - momentum) * square
        else:
            mean_square = momentum * _as(previous, dtype) + (dtype.type(1) - momentum) * square
        state[self.MEAN_SQUARE] = mean_square
        variance_control = dtype.type(self.variance_control) / np.sqrt(mean_square + dtype.type(self.EPSILON))
        gap = _as(value_now, dtype) - _as(value_read, dtype)
        compensated: Array = grad + variance_control * square * gap
        return compensated


@POLICIES.register("gap-aware")
@dataclass(frozen=True)
class GapAware(_GradientCorrection):
    """Gap-Aware: g / G with G = 1 + |w_now - w_read| / C, elementwise.

    Barkai, Hakimi, Schuster, "Gap-Aware Mitigation of Gradient Staleness", ICLR 2020: the Gap
    measures how far the parameters moved since the worker read them, in units of C, the typical
    magnitude of one update step; the gradient is penalized linearly in the Gap.

    With `gap-aware:c=C` the constant C is used. Otherwise C is estimated per element from `state`:
    between two consecutive calls for a variable exactly one update is applied to it, so
    |w_now - w_previous_call| is the size of one step; C is its exponential moving average
    (decay STEP_DECAY, started at the first observed step), floored at MIN_STEP so C > 0 even for
    elements that have not moved. Until a step has been observed (the first call, or when the
    shape changes) there is no scale to measure the Gap in, and the gradient is returned as it is.
    """

    step_size: float | None = param(None, key="c", help="typical step size C (unset: estimated per element)")
    # A ~10-update window: follows a decaying learning rate within a few steps.
    STEP_DECAY: ClassVar[float] = 0.9
    # Around float32 resolution of O(0.1) weights: a smaller "step" is rounding noise.
    MIN_STEP: ClassVar[float] = 1e-8
    PREVIOUS_VALUE: ClassVar[str] = "previous_value"
    STEP: ClassVar[str] = "step_size"

    def __post_init__(self) -> None:
        if self.step_size is not None:
            _check_finite("c", self.step_size, minimum=0.0)
            if not self.step_size > 0:
                raise ValueError(f"c must be > 0, got {self.step_size!r}")

    def adjust(
        self, name: str, grad: Array, value_now: Array, value_read: Array, state: dict[str, Array]
    ) -> Array:
        """The gap-penalized gradient; without a constant C, updates the step estimate in state."""
        dtype = grad.dtype
        now = _as(value_now, dtype)
        step: Any
        if self.step_size is not None:
            step = dtype.type(self.step_size)
        else:
            step = self._observe_step(now, state)
            if step is None:
                return grad.copy()
            step = np.maximum(step, dtype.type(self.MIN_STEP))
        gap = np.abs(now - _as(value_read, dtype))
        penalized: Array = grad / (dtype.type(1) + gap / step)
        return penalized

    def _observe_step(self, now: Array, state: dict[str, Array]) -> Array | None:
        """Fold |now - previous call's value| into the step average; None before the first step."""
        previous = state.get(self.PREVIOUS_VALUE)
        state[self.PREVIOUS_VALUE] = now.copy()
        if previous is None or previous.shape != now.shape:
            state.pop(self.STEP, None)
            return None
        dtype = now.dtype
        observed: Array = np.abs(now - _as(previous, dtype))
        average = state.get(self.STEP)
        if average is None:
            average = observed
        else:
            decay = dtype.type(self.STEP_DECAY)
            average = decay * _as(average, dtype) + (dtype.type(1) - decay) * observed
        state[self.STEP] = average
        return average


def _as(array: Array, dtype: np.dtype[Any]) -> Array:
    """The array in the given dtype, copied only when it has another one."""
    return array.astype(dtype, copy=False)


def _check_finite(what: str, value: float, minimum: float) -> None:
    """Raise ValueError unless value is a finite number >= minimum."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= minimum):
        raise ValueError(f"{what} must be a finite number >= {minimum:g}, got {value!r}")


def parse_policy(spec: str) -> StalenessPolicy:
    """Build a policy from its spec; a malformed spec is a ValueError naming the valid forms."""
    return POLICIES.parse(spec)
