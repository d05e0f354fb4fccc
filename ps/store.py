"""The state of one parameter-server shard: variables, optimizer slots, version, counters.

No grpc here: the servicer adapts the wire to this object, and tests drive it directly.

Locking: every variable has its own lock; a push takes the locks of the variables it touches
(in name order, so two pushes never deadlock) and then the version lock, so applying a push and
bumping the version is atomic and no concurrent update is lost. A pull takes every variable lock,
so the values it returns are a model that existed at the version it reports.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from asyncps.codec import Array, Gradient, SparseRows
from asyncps.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from ps.optimizers import Optimizer, OptimizerConfig, make_optimizer
from ps.policies import StalenessPolicy, parse_policy

MODES = ("async",)


@dataclass(frozen=True)
class UpdateRuleConfig:
    """How the shard turns gradients into updates: optimizer, consistency mode, policy."""

    optimizer: OptimizerConfig
    mode: str = "async"
    staleness_policy: str = "none"
    num_workers: int = 1
    backup_workers: int = 0
    staleness_bound: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; valid: {', '.join(MODES)}")
        parse_policy(self.staleness_policy)
        if self.num_workers < 1 or self.backup_workers < 0 or self.staleness_bound < 0:
            raise ValueError("num_workers must be >= 1, backup_workers and staleness_bound >= 0")


@dataclass(frozen=True)
class PushOutcome:
    """The shard's answer to one push."""

    accepted: bool
    staleness: int
    version: int
    effective_lr: float
    drop_reason: str = ""


@dataclass
class _Variable:
    value: Array
    slots: dict[str, Array]
    lock: threading.Lock = field(default_factory=threading.Lock)
    updates: int = 0


@dataclass(frozen=True)
class StoreStats:
    """Counters and metadata of a shard (no values)."""

    initialized: bool
    version: int
    pushes_accepted: int
    pushes_dropped: int
    variables: tuple[tuple[str, str, tuple[int, ...]], ...]
    rule: UpdateRuleConfig | None


T = TypeVar("T")


def _is_float(dtype: np.dtype[Any]) -> bool:
    return bool(np.issubdtype(dtype, np.floating))


def _all_finite(a: Array) -> bool:
    # A float64 sum propagates NaN/Inf without a bool temporary the size of the tensor, and
    # cannot overflow on float32 inputs.
    return a.size == 0 or bool(np.isfinite(np.add.reduce(a, axis=None, dtype=np.float64)))


class ShardStore:
    """Variables of one shard with their optimizer state and a monotonically increasing version."""

    def __init__(self, shard_index: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        self.shard_index = shard_index
        self._clock = clock
        self._init_lock = threading.Lock()
        self._version_cond = threading.Condition()
        self._vars: dict[str, _Variable] = {}
        self._rule: UpdateRuleConfig | None = None
        self._optimizer: Optimizer | None = None
        self._policy: StalenessPolicy | None = None
        self._version = 0
        self._accepted = 0
        self._dropped = 0

    # -- initialization -------------------------------------------------------------------
    def initialize(self, rule: UpdateRuleConfig, values: Mapping[str, Array]) -> bool:
        """Create the variables; True if created, False if an identical init already happened.

        A conflicting re-initialization (other rule, names, shapes, dtypes or values) raises
        AlreadyExistsError and changes nothing.
        """
        if not values:
            raise InvalidArgumentError("initialize without variables")
        for name, value in values.items():
            if not _is_float(value.dtype):
                raise InvalidArgumentError(f"{name}: variables must be floating point, got {value.dtype}")
            if not _all_finite(value):
                raise InvalidArgumentError(f"{name}: initial value contains NaN or Inf")
        with self._init_lock:
            if self._rule is not None:
                self._check_same_init(rule, values)
                return False
            optimizer = make_optimizer(rule.optimizer)
            self._vars = {
                name: _Variable(value=np.array(value, copy=True), slots=optimizer.init_slots(value))
                for name, value in sorted(values.items())
            }
            self._optimizer = optimizer
            self._policy = parse_policy(rule.staleness_policy)
            self._rule = rule
            return True

    def _check_same_init(self, rule: UpdateRuleConfig, values: Mapping[str, Array]) -> None:
        if rule != self._rule:
            raise AlreadyExistsError(f"shard already initialized with a different rule: {self._rule}")
        if set(values) != set(self._vars):
            raise AlreadyExistsError(
                f"shard already initialized with variables {sorted(self._vars)}, not {sorted(values)}"
            )
        # Compare against the initial values is impossible once training moved them, so an
        # identical re-init means: same names, shapes and dtypes, and (before any update) values.
        with self._all_locks():
            for name, value in values.items():
                var = self._vars[name]
                if var.value.shape != value.shape or var.value.dtype != value.dtype:
                    raise AlreadyExistsError(
                        f"{name}: already initialized as {var.value.dtype}{list(var.value.shape)}, "
                        f"not {value.dtype}{list(value.shape)}"
                    )
                if self._version == 0 and not np.array_equal(var.value, value):
                    raise AlreadyExistsError(f"{name}: already initialized with different values")

    # -- pull -----------------------------------------------------------------------------
    def pull(
        self, if_newer_than: int, encode: Callable[[str, Array], T]
    ) -> tuple[int, list[T] | None]:
        """Encode every variable under the locks (one consistent model) unless not newer.

        `encode(name, value)` runs while the locks are held and must copy what it keeps.
        Returns (version, encoded) with encoded None when version <= if_newer_than.
        """
        self._require_initialized()
        with self._version_cond:
            if self._version <= if_newer_than:
                return self._version, None
        with self._all_locks():
            version = self._version
            return version, [encode(name, var.value) for name, var in self._vars.items()]

    def wait_newer(self, version: int, timeout_s: float) -> int:
        """Block until the shard's version exceeds `version` or timeout; return the version."""
        with self._version_cond:
            self._version_cond.wait_for(lambda: self._version > version, timeout=max(0.0, timeout_s))
            return self._version

    def values(self) -> dict[str, Array]:
        """A consistent copy of every variable (tests, checkpoints)."""
        self._require_initialized()
        with self._all_locks():
            return {name: var.value.copy() for name, var in self._vars.items()}

    # -- push -----------------------------------------------------------------------------
    def push(self, worker_id: str, base_version: int, grads: Mapping[str, Gradient]) -> PushOutcome:
        """Apply (or drop) one gradient computed from `base_version`; never partially.

        Everything is validated before any state changes: unknown names (NotFoundError), shape,
        dtype, indices, NaN/Inf and versions from the future (InvalidArgumentError).
        """
        self._require_initialized()
        if not grads:
            raise InvalidArgumentError("push without gradients")
        if base_version < 0:
            raise InvalidArgumentError(f"base_version must be >= 0, got {base_version}")
        for name, grad in grads.items():
            self._validate_gradient(name, grad)
        assert self._optimizer is not None and self._policy is not None and self._rule is not None
        touched = [self._vars[name] for name in sorted(grads)]
        with contextlib.ExitStack() as stack:
            for var in touched:
                stack.enter_context(var.lock)
            with self._version_cond:
                version_now = self._version
            if base_version > version_now:
                raise InvalidArgumentError(
                    f"base_version {base_version} is from the future: shard version is {version_now}"
                )
            staleness = version_now - base_version
            decision = self._policy.decide(staleness)
            lr = self._rule.optimizer.learning_rate * decision.lr_scale
            if not decision.accept:
                with self._version_cond:
                    self._dropped += 1
                return PushOutcome(False, staleness, version_now, 0.0, decision.reason)
            for name in sorted(grads):
                self._apply(self._vars[name], grads[name], lr)
            with self._version_cond:
                self._version += 1
                self._accepted += 1
                version = self._version
                self._version_cond.notify_all()
        return PushOutcome(True, staleness, version, lr)

    def _apply(self, var: _Variable, grad: Gradient, lr: float) -> None:
        assert self._optimizer is not None
        var.updates += 1
        if isinstance(grad, SparseRows):
            self._optimizer.apply_sparse(var.value, grad.indices, grad.values, var.slots, lr, var.updates)
        else:
            self._optimizer.apply_dense(var.value, grad, var.slots, lr, var.updates)

    def _validate_gradient(self, name: str, grad: Gradient) -> None:
        var = self._vars.get(name)
        if var is None:
            raise NotFoundError(f"unknown variable {name!r} on shard {self.shard_index}")
        shape, dtype = var.value.shape, var.value.dtype
        if isinstance(grad, SparseRows):
            values = grad.values
            if values.shape[1:] != shape[1:] or values.ndim != len(shape):
                raise InvalidArgumentError(
                    f"{name}: sparse rows of shape {list(values.shape)} do not fit a variable "
                    f"of shape {list(shape)}"
                )
            if grad.indices.size and (grad.indices.min() < 0 or grad.indices.max() >= shape[0]):
                raise InvalidArgumentError(f"{name}: sparse row index outside [0, {shape[0]})")
        else:
            values = grad
            if values.shape != shape:
                raise InvalidArgumentError(
                    f"{name}: gradient shape {list(values.shape)} != variable shape {list(shape)}"
                )
        if values.dtype != dtype:
            raise InvalidArgumentError(f"{name}: gradient dtype {values.dtype} != variable dtype {dtype}")
        if not _all_finite(values):
            raise InvalidArgumentError(f"{name}: gradient contains NaN or Inf")

    # -- introspection --------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The number of updates applied so far."""
        with self._version_cond:
            return self._version

    @property
    def rule(self) -> UpdateRuleConfig | None:
        """The update rule, once initialized."""
        return self._rule

    def stats(self) -> StoreStats:
        """Counters and variable metadata."""
        with self._version_cond:
            version, accepted, dropped = self._version, self._accepted, self._dropped
        return StoreStats(
            initialized=self._rule is not None,
            version=version,
            pushes_accepted=accepted,
            pushes_dropped=dropped,
            variables=tuple((n, v.value.dtype.name, v.value.shape) for n, v in self._vars.items()),
            rule=self._rule,
        )

    def _require_initialized(self) -> None:
        if self._rule is None:
            raise FailedPreconditionError(f"shard {self.shard_index} is not initialized yet")

    @contextlib.contextmanager
    def _all_locks(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for name in sorted(self._vars):
                stack.enter_context(self._vars[name].lock)
            yield
