"""Staleness policies: how a shard treats a gradient according to its staleness.

Each policy is a small object with one job, chosen by a spec string (see `VALID_SPECS`); the
store calls `decide` (and `adjust` where `needs_read_values`) and never branches on the kind.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from asyncps.codec import Array
from asyncps.rules.drops import DropReason

VALID_SPECS = "none, drop:K, lr-scale, dc-asgd[:LAMBDA], dc-asgd-a[:LAMBDA0[,MOMENTUM]], gap-aware[:C]"


@dataclass(frozen=True)
class Decision:
    """What to do with one gradient: apply it (with the learning rate scaled) or drop it."""

    accept: bool
    lr_scale: float = 1.0
    reason: str = ""
    drop: DropReason | None = None  # the kind of a refusal


class StalenessPolicy(abc.ABC):
    """Decides, from a gradient's staleness, whether and how strongly to apply it.

    Policies that correct the gradient itself (DC-ASGD, gap-aware) set `needs_read_values`; the
    store then keeps, per worker, a copy of the values that worker last pulled and calls
    `adjust` for every (dense, or the touched rows of a sparse) gradient before applying it.
    """

    spec: str
    needs_read_values: bool = False

    @abc.abstractmethod
    def decide(self, staleness: int) -> Decision:
        """The decision for one gradient with the given staleness (>= 0)."""

    def adjust(
        self, name: str, grad: Array, value_now: Array, value_read: Array, state: dict[str, Array]
    ) -> Array:
        """The gradient to apply, given the current values and those the worker read.

        All arrays have the gradient's shape (for sparse gradients: the touched rows). `state`
        is this policy's per-variable scratch space, owned by the store, for running averages.
        Must not modify grad, value_now or value_read in place.
        """
        return grad


class ApplyAll(StalenessPolicy):
    """Plain asynchronous SGD: every gradient is applied as it is."""

    spec = "none"

    def decide(self, staleness: int) -> Decision:
        """Always apply at the full learning rate."""
        return Decision(True)


@dataclass(frozen=True)
class DropAbove(StalenessPolicy):
    """Drop gradients whose staleness exceeds a bound K."""

    bound: int

    @property
    def spec(self) -> str:  # type: ignore[override]
        """The spec string this policy was parsed from."""
        return f"drop:{self.bound}"

    def decide(self, staleness: int) -> Decision:
        """Apply when staleness <= K, else drop with the reason."""
        if staleness > self.bound:
            return Decision(False, reason=f"staleness {staleness} > {self.bound}", drop=DropReason.STALE)
        return Decision(True)


class LrScale(StalenessPolicy):
    """Staleness-aware learning rate alpha / max(1, tau) (Zhang et al. 2016)."""

    spec = "lr-scale"

    def decide(self, staleness: int) -> Decision:
        """Apply with the learning rate divided by max(1, staleness)."""
        return Decision(True, lr_scale=1.0 / max(1, staleness))


class _GradientCorrection(StalenessPolicy):
    """Base of the policies that correct a stale gradient instead of scaling or dropping it."""

    needs_read_values = True

    def decide(self, staleness: int) -> Decision:
        """Always apply at the full learning rate: `adjust` does the mitigation."""
        return Decision(True)


@dataclass(frozen=True)
class DelayCompensated(_GradientCorrection):
    """DC-ASGD-c: g + lambda * g * g * (w_now - w_read).

    Zheng et al., "Asynchronous Stochastic Gradient Descent with Delay Compensation", ICML 2017:
    a first-order Taylor correction of the delayed gradient, with the Hessian approximated by
    lambda * g * g (the diagonal of the outer product, lambda the "variance control parameter").
    The default 0.04 is the value the paper runs DC-ASGD-c with, and MXNet's DCASGD default.
    """

    variance_control: float = 0.04

    def __post_init__(self) -> None:
        _check_finite("LAMBDA", self.variance_control, minimum=0.0)

    @property
    def spec(self) -> str:  # type: ignore[override]
        """The canonical spec string; parse_policy(spec) rebuilds an equal policy."""
        return _format_spec("dc-asgd", (self.variance_control,), (0.04,))

    def adjust(
        self, name: str, grad: Array, value_now: Array, value_read: Array, state: dict[str, Array]
    ) -> Array:
        """The delay-compensated gradient, in the gradient's dtype."""
        dtype = grad.dtype
        gap = _as(value_now, dtype) - _as(value_read, dtype)
        compensated: Array = grad + dtype.type(self.variance_control) * grad * grad * gap
        return compensated


@dataclass(frozen=True)
class AdaptiveDelayCompensated(_GradientCorrection):
    """DC-ASGD-a: DC-ASGD with lambda_t = lambda0 / sqrt(mean_square_t + eps), elementwise.

    Zheng et al., ICML 2017, the adaptive variant: mean_square_t = m * mean_square_{t-1} +
    (1 - m) * g * g, updated with the current gradient before lambda_t is computed and starting
    from zero, as in the authors' Multiverso updater (which also fixes eps = 1e-7). Defaults are the
    paper's DC-ASGD-a setting: lambda0 = 2, m = 0.95. The running mean square lives in `state`,
    one per variable (the reference keeps one per worker; per variable matches the store's state).
    """

    variance_control: float = 2.0
    momentum: float = 0.95
    EPSILON: ClassVar[float] = 1e-7
    MEAN_SQUARE: ClassVar[str] = "mean_square"

    def __post_init__(self) -> None:
        _check_finite("LAMBDA0", self.variance_control, minimum=0.0)
        _check_finite("MOMENTUM", self.momentum, minimum=0.0)
        if not self.momentum < 1.0:
            raise ValueError(f"MOMENTUM must be in [0, 1), got {self.momentum!r}")

    @property
    def spec(self) -> str:  # type: ignore[override]
        """The canonical spec string; parse_policy(spec) rebuilds an equal policy."""
        return _format_spec("dc-asgd-a", (self.variance_control, self.momentum), (2.0, 0.95))

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


@dataclass(frozen=True)
class GapAware(_GradientCorrection):
    """Gap-Aware: g / G with G = 1 + |w_now - w_read| / C, elementwise.

    Barkai, Hakimi, Schuster, "Gap-Aware Mitigation of Gradient Staleness", ICLR 2020: the Gap
    measures how far the parameters moved since the worker read them, in units of C, the typical
    magnitude of one update step; the gradient is penalized linearly in the Gap.

    With `gap-aware:C` the constant C is used. Otherwise C is estimated per element from `state`:
    between two consecutive calls for a variable exactly one update is applied to it, so
    |w_now - w_previous_call| is the size of one step; C is its exponential moving average
    (decay STEP_DECAY, started at the first observed step), floored at MIN_STEP so C > 0 even for
    elements that have not moved. Until a step has been observed (the first call, or when the
    shape changes) there is no scale to measure the Gap in, and the gradient is returned as it is.
    """

    step_size: float | None = None
    # A ~10-update window: follows a decaying learning rate within a few steps.
    STEP_DECAY: ClassVar[float] = 0.9
    # Around float32 resolution of O(0.1) weights: a smaller "step" is rounding noise.
    MIN_STEP: ClassVar[float] = 1e-8
    PREVIOUS_VALUE: ClassVar[str] = "previous_value"
    STEP: ClassVar[str] = "step_size"

    def __post_init__(self) -> None:
        if self.step_size is not None:
            _check_finite("C", self.step_size, minimum=0.0)
            if not self.step_size > 0:
                raise ValueError(f"C must be > 0, got {self.step_size!r}")

    @property
    def spec(self) -> str:  # type: ignore[override]
        """The canonical spec string; parse_policy(spec) rebuilds an equal policy."""
        if self.step_size is None:
            return "gap-aware"
        return f"gap-aware:{_format_number(self.step_size)}"

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


def _format_number(value: float) -> str:
    """The shortest text float() reads back exactly, without a trailing '.0'."""
    text = repr(float(value))
    return text[:-2] if text.endswith(".0") else text


def _format_spec(name: str, values: tuple[float, ...], defaults: tuple[float, ...]) -> str:
    """`name[:v1[,v2]]`, leaving out trailing values equal to their defaults."""
    shown = list(values)
    while shown and shown[-1] == defaults[len(shown) - 1]:
        shown.pop()
    return f"{name}:{','.join(_format_number(v) for v in shown)}" if shown else name


def _parse_numbers(arg: str | None, names: tuple[str, ...]) -> list[float]:
    """The comma-separated numbers of a spec's argument: at most len(names) of them."""
    if arg is None:
        return []
    parts = arg.split(",")
    if len(parts) > len(names):
        raise ValueError(f"takes at most {len(names)} number(s) ({','.join(names)}), got {len(parts)}")
    numbers = []
    for what, text in zip(names, parts, strict=False):
        try:
            numbers.append(float(text))
        except ValueError:
            raise ValueError(f"{what} must be a number, got {text!r}") from None
    return numbers


def _parse_drop(arg: str | None) -> StalenessPolicy:
    try:
        bound = int(arg or "")
    except ValueError:
        raise ValueError("drop needs an integer bound, e.g. drop:4") from None
    if bound < 0:
        raise ValueError("the bound must be >= 0")
    return DropAbove(bound)


def _parse_dc_asgd(arg: str | None) -> StalenessPolicy:
    return DelayCompensated(*_parse_numbers(arg, ("LAMBDA",)))


def _parse_dc_asgd_adaptive(arg: str | None) -> StalenessPolicy:
    return AdaptiveDelayCompensated(*_parse_numbers(arg, ("LAMBDA0", "MOMENTUM")))


def _parse_gap_aware(arg: str | None) -> StalenessPolicy:
    return GapAware(*_parse_numbers(arg, ("C",)))


# The tables from a spec's name to its policy: those written without ':', and the parsers of
# those that take an argument (each gets the text after ':', or None when there is no ':').
_WITHOUT_ARGUMENT: dict[str, Callable[[], StalenessPolicy]] = {"none": ApplyAll, "lr-scale": LrScale}
_PARSERS: dict[str, Callable[[str | None], StalenessPolicy]] = {
    "drop": _parse_drop,
    "dc-asgd": _parse_dc_asgd,
    "dc-asgd-a": _parse_dc_asgd_adaptive,
    "gap-aware": _parse_gap_aware,
}


def parse_policy(spec: str) -> StalenessPolicy:
    """Build a policy from its spec; a malformed spec is a ValueError naming the valid forms."""
    name, colon, arg = spec.partition(":")
    if name in _WITHOUT_ARGUMENT and not colon:
        return _WITHOUT_ARGUMENT[name]()
    parser = _PARSERS.get(name)
    if parser is None:
        raise ValueError(f"unknown staleness policy {spec!r}; valid: {VALID_SPECS}")
    try:
        return parser(arg if colon else None)
    except ValueError as error:
        raise ValueError(f"staleness policy {spec!r}: {error}; valid: {VALID_SPECS}") from None
