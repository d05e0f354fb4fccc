"""Optimizer update rules for a parameter-server shard, written in pure numpy.

Each rule reproduces the float32 arithmetic of its keras 3 counterpart
(``keras.optimizers.SGD`` with and without (Nesterov) momentum, ``Adam`` and
``Adagrad``), including keras' defaults and epsilon placement, so a model
trained through the parameter server follows the same trajectory as one
trained locally with keras.

An :class:`Optimizer` holds only hyperparameters. Per-variable state (the
"slots") is created by :meth:`Optimizer.init_slots` and owned by the caller,
so one optimizer instance can serve every variable of a shard, from any
number of threads, as long as each variable is updated by one thread at a time.
"""

from __future__ import annotations

import abc
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from asyncps.rules.registry import Registry, format_value, param

FloatArray = npt.NDArray[np.float32]
IndexArray = npt.NDArray[np.int64]
Slots = dict[str, FloatArray]
# The learning rate a rule's update uses: one for the whole update, or one per row (broadcast over a row's
# other axes: a per-row staleness policy's scaled rates, apply_sparse's `row_scale`)
Rate = np.float32 | FloatArray
# Elements per block of a dense update (256 KiB of float32: the temporaries stay in L2).
_BLOCK = 1 << 16


@dataclass(frozen=True)
class OptimizerConfig:
    """Which update rule a shard applies, its base learning rate and hyperparameters.

    As a spec: `NAME:lr=LR[,KEY=VALUE...]` (`spec`, `parse`), the hyperparameters those of the
    optimizer registered as NAME in OPTIMIZERS. A learning-rate schedule, Keras' ExponentialDecay, rides
    beside them with the keys of SCHEDULE_KEYS (`decay_steps=N,decay_rate=R[,staircase=1]`, given as
    hyperparameters too): the rate at update t is `lr * R ** (t / N)` (t / N floored with staircase), t the
    shard's version (the updates it has applied), or a local optimizer's own step count. Keras' decoupled weight
    decay rides beside them too (`weight_decay=W`): before each update, `value -= value * W * rate`, as every
    Keras 3 optimizer applies it (AdamW is Adam with it); a sparse update decays the rows it touches only.
    """

    name: str
    learning_rate: float
    params: Mapping[str, float] = field(default_factory=dict)
    decay_steps: float = 0.0  # 0: a constant rate
    decay_rate: float = 1.0
    staircase: bool = False
    weight_decay: float = 0.0  # 0: none

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ValueError(f"unknown optimizer {self.name!r}; expected one of {sorted(OPTIMIZERS.names())}")
        OPTIMIZERS.entry(self.name)  # loads a plugin; unknown: ValueError naming the valid ones
        lr = _as_real("learning_rate", self.learning_rate)
        if not lr > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate!r}")
        if not isinstance(self.params, Mapping):
            raise ValueError(f"params must be a mapping, got {type(self.params).__name__}")
        self._take_schedule()
        accepted = frozenset(p.key for p in OPTIMIZERS.entry(self.name).params)
        unknown = sorted(set(self.params) - accepted)
        if unknown:
            raise ValueError(
                f"unknown parameter(s) {unknown} for optimizer {self.name!r}; "
                f"accepted: {sorted(accepted)}"
            )
        # Normalised copies: the frozen config must not alias a dict the caller may mutate.
        object.__setattr__(self, "learning_rate", lr)
        object.__setattr__(
            self,
            "params",
            {key: _check_hyperparameter(key, value) for key, value in self.params.items()},
        )

    def _take_schedule(self) -> None:
        """Move the schedule's and weight decay's keys given among the hyperparameters to their fields, and check
        them."""
        given = {key: self.params[key] for key in (*SCHEDULE_KEYS, WEIGHT_DECAY) if key in self.params}
        if given:
            object.__setattr__(self, "params", {k: v for k, v in self.params.items() if k not in given})
            object.__setattr__(self, "decay_steps", float(given.get("decay_steps", self.decay_steps)))
            object.__setattr__(self, "decay_rate", float(given.get("decay_rate", self.decay_rate)))
            object.__setattr__(self, "staircase", bool(given.get("staircase", self.staircase)))
            object.__setattr__(self, "weight_decay", float(given.get(WEIGHT_DECAY, self.weight_decay)))
        decay = _as_real(WEIGHT_DECAY, self.weight_decay)
        if not 0 <= decay < math.inf:
            raise ValueError(f"weight_decay must be >= 0 and finite, got {self.weight_decay!r}")
        steps, rate = _as_real("decay_steps", self.decay_steps), _as_real("decay_rate", self.decay_rate)
        if steps < 0 or not 0 < rate <= 1 or (rate != 1 and steps == 0) or (steps and rate == 1):
            raise ValueError(f"a learning-rate schedule needs decay_steps > 0 and decay_rate in (0, 1) together, "
                             f"got decay_steps={self.decay_steps!r}, decay_rate={self.decay_rate!r}")

    def rate_at(self, step: int) -> float:
        """The learning rate at update `step` (0-based: the updates applied before this one)."""
        if not self.decay_steps:
            return self.learning_rate
        exponent = step / self.decay_steps
        return self.learning_rate * self.decay_rate ** (math.floor(exponent) if self.staircase else exponent)

    @property
    def spec(self) -> str:
        """`name:lr=LR` and the given hyperparameters in key order (a schedule's keys last); parse(spec) == self."""
        items = [f"lr={format_value(self.learning_rate)}"]
        items += [f"{key}={format_value(value)}" for key, value in sorted(self.params.items())]
        if self.decay_steps:
            items += [f"decay_steps={format_value(self.decay_steps)}", f"decay_rate={format_value(self.decay_rate)}"]
            items += ["staircase=1"] if self.staircase else []
        if self.weight_decay:
            items += [f"{WEIGHT_DECAY}={format_value(self.weight_decay)}"]
        return f"{self.name}:{','.join(items)}"

    @classmethod
    def parse(cls, spec: str) -> OptimizerConfig:
        """The config a spec names (ValueError naming the kind, the spec and the valid forms)."""
        name, texts = OPTIMIZERS.split(spec, extra=("lr", *SCHEDULE_KEYS, WEIGHT_DECAY))
        usage = f"{name}:lr=FLOAT" + "".join(f"[,{p.usage()}]" for p in OPTIMIZERS.entry(name).params)
        try:
            if "lr" not in texts:
                raise ValueError("the learning rate lr=FLOAT is required")
            numbers = {key: _spec_number(key, text) for key, text in texts.items()}
            lr = numbers.pop("lr")
            return cls(name, lr, numbers)  # the schedule's keys leave the hyperparameters in __post_init__
        except ValueError as error:
            raise ValueError(f"optimizer {spec!r}: {error}; valid: {usage}") from None


#: The keys of a learning-rate schedule (OptimizerConfig), accepted beside any optimizer's hyperparameters
SCHEDULE_KEYS = ("decay_steps", "decay_rate", "staircase")
#: The key of decoupled weight decay (OptimizerConfig), accepted beside any optimizer's hyperparameters
WEIGHT_DECAY = "weight_decay"


def _spec_number(key: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{key} must be a number, got {text!r}") from None


class Optimizer(abc.ABC):
    """Update rule for one variable at a time; state lives in `slots` owned by the caller.

    Each rule is a frozen dataclass of its hyperparameters, registered in OPTIMIZERS.
    """

    name: ClassVar[str]
    # Names of the state arrays init_slots creates, each shaped like the variable.
    slot_names: ClassVar[tuple[str, ...]] = ()
    # Keys an OptimizerConfig may set in `params` for this rule.
    hyperparameters: ClassVar[frozenset[str]] = frozenset()

    def init_slots(self, value: FloatArray) -> Slots:
        """Return fresh optimizer state for `value`: one zero array per slot name."""
        return {slot: np.zeros_like(value) for slot in self.slot_names}

    def apply_dense(
        self, value: FloatArray, grad: FloatArray, slots: Slots, lr: float, step: int,
        source: FloatArray | None = None,
    ) -> None:
        """Apply one update with a full-shape gradient, in place on `value` and `slots`.

        `lr` is the learning rate for this update (callers may have scaled it);
        `step` is the 1-based number of updates applied to this variable,
        counting this one. `grad` is never modified. With `source`, the values before the update
        are read from there and the result written to `value` (a shard's copy-on-write: each block
        is copied and updated while in cache, one pass over memory instead of a copy, then an update).
        """
        grad = np.asarray(grad, dtype=value.dtype)
        if grad.shape != value.shape:
            raise ValueError(f"gradient shape {grad.shape} != variable shape {value.shape}")
        if source is not None and (source.shape != value.shape or source.dtype != value.dtype):
            raise ValueError(f"source {source.dtype}{list(source.shape)} != variable {value.dtype}{list(value.shape)}")
        _check_step(step)
        lr_typed = value.dtype.type(lr)
        contiguous = value.flags.c_contiguous and all(a.flags.c_contiguous for a in slots.values())
        if value.size <= _BLOCK or not contiguous or (source is not None and not source.flags.c_contiguous):
            if source is not None:
                np.copyto(value, source)
            self._apply(value, grad, slots, lr_typed, step)
            return
        # Every rule is elementwise, so updating block by block gives the same bits while the
        # temporaries stay in cache (a 40 MB SGD step: 25 ms whole, about half in blocks).
        flat_value, flat_grad = value.reshape(-1), grad.reshape(-1)
        flat_source = None if source is None else source.reshape(-1)
        flat_slots = {name: a.reshape(-1) for name, a in slots.items()}
        for start in range(0, value.size, _BLOCK):
            block = slice(start, start + _BLOCK)
            if flat_source is not None:
                np.copyto(flat_value[block], flat_source[block])
            self._apply(flat_value[block], flat_grad[block], {k: a[block] for k, a in flat_slots.items()},
                        lr_typed, step)

    def apply_sparse(
        self,
        value: FloatArray,
        indices: IndexArray,
        rows: FloatArray,
        slots: Slots,
        lr: float,
        step: int,
        row_scale: FloatArray | None = None,
    ) -> None:
        """Apply one update given as gradient rows for some rows (axis 0) of `value`, in place.

        `indices` is an integer array of shape ``[k]`` and `rows` has shape
        ``[k, *value.shape[1:]]``. Rows named more than once are summed first,
        so for plain SGD the result equals :meth:`apply_dense` with the
        scattered gradient.

        The update is *lazy*, like TensorFlow's ``LazyAdam``: only the touched
        rows of `value` and of every slot change; untouched rows are left
        bit-for-bit as they were, rather than having momentum decay or Adam
        moments shrink as a dense zero-gradient step would do. Adam's bias
        correction still uses the variable-wide `step`. Consequently, for
        momentum, Nesterov, Adam and Adagrad a sparse update equals the dense
        one only when it touches every row.

        `row_scale` (a per-row staleness policy's): each row's learning rate is `lr` times its scale, one
        scale per index; the indices must then be strictly increasing (each row named once).
        """
        if value.ndim == 0:
            raise ValueError("sparse updates need a variable with at least one axis")
        _check_step(step)
        unique, summed = _coalesce(value, indices, rows)
        if unique.size == 0:
            return
        # Gather the touched rows, run the dense rule on them, scatter back: the
        # per-row arithmetic is then identical to the dense path by construction.
        value_rows = value[unique]
        slot_rows = {slot: state[unique] for slot, state in slots.items()}
        self._apply(value_rows, summed, slot_rows, _row_rates(value, indices, lr, row_scale), step)
        value[unique] = value_rows
        for slot, state_rows in slot_rows.items():
            slots[slot][unique] = state_rows

    @abc.abstractmethod
    def _apply(
        self, value: FloatArray, grad: FloatArray, slots: Slots, lr: Rate, step: int
    ) -> None:
        """Update `value` and `slots` in place from a validated, same-dtype, same-shape `grad`."""



OPTIMIZERS: Registry[Optimizer] = Registry("optimizer", Optimizer, group="asyncps.optimizers")


@OPTIMIZERS.register("sgd")
@dataclass(frozen=True)
class SGD(Optimizer):
    """Plain gradient descent: ``value -= lr * grad`` (keras ``SGD()``)."""

    name = "sgd"

    def _apply(
        self, value: FloatArray, grad: FloatArray, slots: Slots, lr: Rate, step: int
    ) -> None:
        value -= np.multiply(grad, lr)


@OPTIMIZERS.register("momentum")
@dataclass(frozen=True)
class Momentum(Optimizer):
    """Heavy-ball momentum (keras ``SGD(momentum=m)``): ``v = m*v - lr*g; value += v``."""

    name = "momentum"
    slot_names = ("momentum",)
    hyperparameters = frozenset({"momentum"})

    momentum: float = param(0.9, help="velocity decay m, in [0, 1]")

    def __post_init__(self) -> None:
        object.__setattr__(self, "momentum", _check_hyperparameter("momentum", self.momentum))

    def _apply(
        self, value: FloatArray, grad: FloatArray, slots: Slots, lr: Rate, step: int
    ) -> None:
        velocity = slots["momentum"]
        mu = value.dtype.type(self.momentum)
        scaled_grad = np.multiply(grad, lr)
        velocity *= mu
        velocity -= scaled_grad
        self._move(value, velocity, scaled_grad, mu)

    def _move(
        self, value: FloatArray, velocity: FloatArray, scaled_grad: FloatArray, mu: np.float32
    ) -> None:
        """Step `value` once `velocity` holds this update's new velocity."""
        value += velocity


@OPTIMIZERS.register("nesterov")
@dataclass(frozen=True)
class Nesterov(Momentum):
    """Nesterov momentum (keras ``SGD(momentum=m, nesterov=True)``): ``value += m*v - lr*g``."""

    name = "nesterov"

    def _move(
        self, value: FloatArray, velocity: FloatArray, scaled_grad: FloatArray, mu: np.float32
    ) -> None:
        """Step `value` by the look-ahead ``mu * velocity - lr * grad``."""
        look_ahead = np.multiply(velocity, mu)
        look_ahead -= scaled_grad
        value += look_ahead


@OPTIMIZERS.register("delayed-nesterov")
@dataclass(frozen=True)
class DelayedNesterov(Optimizer):
    """Nesterov momentum whose velocity moves once per `period` updates (async local SGD's outer rule).

    After Liu et al. 2024's "delayed Nesterov": momentum on every single stale delta accelerates the
    center too far.

    Every update moves the value by ``lr * g / period`` and adds `g` to a running sum; the
    `period`-th update also updates the velocity with the mean of the sum, ``v = m*v - lr*mean``,
    moves the value by the look-ahead ``m*v`` and clears the sum. Over `period` updates with the
    same mean gradient this is exactly one keras Nesterov step (``value += m*v - lr*mean``): with
    `period` workers and no staleness, async lands where sync Nesterov averaging does.
    """

    name = "delayed-nesterov"
    slot_names = ("momentum", "sum")
    hyperparameters = frozenset({"momentum", "period"})

    momentum: float = param(0.9, help="velocity decay m, in [0, 1]")
    period: int = param(2, help="updates per momentum step (the number of workers), an integer >= 1")

    def __post_init__(self) -> None:
        object.__setattr__(self, "momentum", _check_hyperparameter("momentum", self.momentum))
        period = _check_hyperparameter("period", self.period)
        if period != int(period):
            raise ValueError(f"period must be an integer >= 1, got {self.period!r}")
        object.__setattr__(self, "period", int(period))

    def _apply(
        self, value: FloatArray, grad: FloatArray, slots: Slots, lr: Rate, step: int
    ) -> None:
        dtype = value.dtype.type
        total, velocity = slots["sum"], slots["momentum"]
        value -= np.multiply(grad, lr / dtype(self.period))
        total += grad
        if step % self.period == 0:
            mu = dtype(self.momentum)
            velocity *= mu
            velocity -= np.multiply(total, lr / dtype(self.period))
            value += np.multiply(velocity, mu)
            total[...] = 0


@OPTIMIZERS.register("adam")
@dataclass(frozen=True)
class Adam(Optimizer):
    """Adam (keras ``Adam``), with bias correction folded into the step size as keras does.

    As in keras, bias correction is folded into the step size,
    ``alpha = lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)`` and
    ``value -= alpha * m / (sqrt(v) + epsilon)``, which is *not* the
    paper's ``m_hat / (sqrt(v_hat) + epsilon)``: epsilon is effectively scaled by
    ``sqrt(1 - beta_2**t)``.
    """

    name = "adam"
    slot_names = ("momentum", "velocity")
    hyperparameters = frozenset({"beta_1", "beta_2", "epsilon"})

    beta_1: float = param(0.9, help="decay of the first moment, in [0, 1)")
    beta_2: float = param(0.999, help="decay of the second moment, in [0, 1)")
    epsilon: float = param(1e-7, help="added to sqrt(v), > 0")

    def __post_init__(self) -> None:
        for key in ("beta_1", "beta_2", "epsilon"):
            object.__setattr__(self, key, _check_hyperparameter(key, getattr(self, key)))

    def _apply(
        self, value: FloatArray, grad: FloatArray, slots: Slots, lr: Rate, step: int
    ) -> None:
        m, v = slots["momentum"], slots["velocity"]
        dtype = value.dtype.type
        t = dtype(step)
        # keras computes the beta powers and alpha in the variable dtype, but
        # 1 - beta in Python double precision; mirror both roundings.
        alpha = lr * np.sqrt(1 - dtype(self.beta_2) ** t) / (1 - dtype(self.beta_1) ** t)
        one_minus_beta_1 = dtype(1.0 - self.beta_1)
        one_minus_beta_2 = dtype(1.0 - self.beta_2)

        # One scratch buffer serves the moment updates and the denominator.
        scratch = np.subtract(grad, m)
        scratch *= one_minus_beta_1
        m += scratch  # m += (g - m) * (1 - beta_1), keras' form of the EMA
        np.square(grad, out=scratch)
        scratch -= v
        scratch *= one_minus_beta_2
        v += scratch
        # A second buffer keeps keras' (m * alpha) / denom operation order: the
        # cheaper (m / denom) * alpha drifts by ulps that compound over steps.
        step_size = np.multiply(m, alpha)
        np.sqrt(v, out=scratch)
        scratch += dtype(self.epsilon)
        step_size /= scratch
        value -= step_size


@OPTIMIZERS.register("adagrad")
@dataclass(frozen=True)
class Adagrad(Optimizer):
    """Adagrad (keras ``Adagrad``): ``acc += g**2; value -= lr * g / sqrt(acc + epsilon)``."""

    name = "adagrad"
    slot_names = ("accumulator",)
    hyperparameters = frozenset({"initial_accumulator_value", "epsilon"})

    initial_accumulator_value: float = param(0.1, help="starting value of the accumulator, >= 0")
    epsilon: float = param(1e-7, help="added to the accumulator under the square root, > 0")

    def __post_init__(self) -> None:
        for key in ("initial_accumulator_value", "epsilon"):
            object.__setattr__(self, key, _check_hyperparameter(key, getattr(self, key)))

    def init_slots(self, value: FloatArray) -> Slots:
        """Return an accumulator filled with `initial_accumulator_value`, shaped like `value`."""
        return {"accumulator": np.full_like(value, self.initial_accumulator_value)}

    def _apply(
        self, value: FloatArray, grad: FloatArray, slots: Slots, lr: Rate, step: int
    ) -> None:
        accumulator = slots["accumulator"]
        scratch = np.square(grad)
        accumulator += scratch
        # keras puts epsilon inside the square root (unlike its Adam).
        np.add(accumulator, value.dtype.type(self.epsilon), out=scratch)
        np.sqrt(scratch, out=scratch)
        # A second buffer keeps keras' (lr * g) / denom operation order, which
        # makes the result bit-identical rather than ulps apart.
        step_size = np.multiply(grad, lr)
        step_size /= scratch
        value -= step_size


def make_optimizer(config: OptimizerConfig) -> Optimizer:
    """Build the optimizer `config` names, with its params overriding keras' defaults (and its weight decay)."""
    optimizer: Optimizer = OPTIMIZERS.entry(config.name).cls(**config.params)
    return WeightDecayed(optimizer, config.weight_decay) if config.weight_decay else optimizer


class WeightDecayed(Optimizer):
    """An optimizer with Keras' decoupled weight decay before each update: `value -= value * decay * lr` (the
    rate of this update), then the optimizer's own step; on a sparse update, on the touched rows only."""

    def __init__(self, inner: Optimizer, decay: float) -> None:
        self.inner = inner
        self.decay = decay
        self.name = inner.name  # type: ignore[misc]  # the inner rule's, per instance
        self.slot_names = inner.slot_names  # type: ignore[misc]

    def init_slots(self, value: FloatArray) -> Slots:
        """The inner optimizer's slots."""
        return self.inner.init_slots(value)

    def _apply(self, value: FloatArray, grad: FloatArray, slots: Slots, lr: Rate, step: int) -> None:
        value -= (value * value.dtype.type(self.decay)) * lr
        self.inner._apply(value, grad, slots, lr, step)


# Allowed range of every hyperparameter: (low, high, low inclusive, high inclusive).
_BOUNDS: dict[str, tuple[float, float, bool, bool]] = {
    "momentum": (0.0, 1.0, True, True),
    # beta == 1 would make the bias correction 1 - beta**t zero.
    "beta_1": (0.0, 1.0, True, False),
    "beta_2": (0.0, 1.0, True, False),
    # epsilon == 0 lets an all-zero slot row turn into 0/0 = NaN.
    "epsilon": (0.0, math.inf, False, False),
    "initial_accumulator_value": (0.0, math.inf, True, False),
    "period": (1.0, math.inf, True, False),
}


def _as_real(key: str, value: object) -> float:
    """Return `value` as a finite float, or raise ValueError naming `key`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{key} must be a real number, got {value!r}")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"{key} must be finite, got {value!r}")
    return result


def _check_hyperparameter(key: str, value: object) -> float:
    """Return hyperparameter `key` as a float after checking it lies in its allowed range."""
    result = _as_real(key, value)
    low, high, low_inclusive, high_inclusive = _BOUNDS[key]
    above = result >= low if low_inclusive else result > low
    below = result <= high if high_inclusive else result < high
    if not (above and below):
        interval = f"{'[' if low_inclusive else '('}{low}, {high}{']' if high_inclusive else ')'}"
        raise ValueError(f"{key} must be in {interval}, got {value!r}")
    return result


def _check_step(step: int) -> None:
    """Reject step counts below 1 (Adam's bias correction divides by 1 - beta_1**step)."""
    if step < 1:
        raise ValueError(f"step is the 1-based update count and must be >= 1, got {step}")


def _row_rates(value: FloatArray, indices: IndexArray, lr: float, row_scale: FloatArray | None) -> Rate:
    """The rate of a sparse update: `lr`, or `lr` times each row's scale (shaped to broadcast over a row)."""
    rate = value.dtype.type(lr)
    if row_scale is None:
        return rate
    scale = np.asarray(row_scale, dtype=value.dtype)
    if scale.shape != indices.shape:
        raise ValueError(f"row_scale has shape {scale.shape}, not one scale per index {indices.shape}")
    if indices.size > 1 and not bool(np.all(indices[1:] > indices[:-1])):
        raise ValueError("row_scale needs strictly increasing indices (each row named once)")
    if not bool(np.all(np.isfinite(scale))) or bool(np.any(scale < 0)):
        raise ValueError("row_scale must be finite and >= 0")
    rates: FloatArray = (rate * scale).reshape(-1, *([1] * (value.ndim - 1)))
    return rates


def _coalesce(
    value: FloatArray, indices: IndexArray, rows: FloatArray
) -> tuple[IndexArray, FloatArray]:
    """Validate a sparse gradient for `value` and sum the rows of duplicate indices."""
    indices = np.asarray(indices)
    if indices.ndim != 1 or not np.issubdtype(indices.dtype, np.integer):
        raise ValueError(
            f"indices must be a 1-D integer array, got shape {indices.shape} dtype {indices.dtype}"
        )
    rows = np.asarray(rows, dtype=value.dtype)
    expected = (indices.shape[0], *value.shape[1:])
    if rows.shape != expected:
        raise ValueError(f"rows shape {rows.shape} != expected {expected}")
    if indices.size == 0:
        return indices, rows
    # Negative ids would silently wrap around under numpy indexing.
    if indices.min() < 0 or indices.max() >= value.shape[0]:
        raise IndexError(f"row indices must lie in [0, {value.shape[0]})")
    unique, inverse = np.unique(indices, return_inverse=True)
    if unique.size == indices.size:
        # No duplicates: skip the scatter-add and its [k, ...] allocation.
        return indices, rows
    summed = np.zeros((unique.size, *rows.shape[1:]), dtype=value.dtype)
    np.add.at(summed, inverse, rows)
    return unique, summed
