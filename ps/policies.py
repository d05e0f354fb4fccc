"""Staleness policies: how a shard treats a gradient according to its staleness.

Each policy is a small object with one job, chosen by a spec string (`none`, `drop:K`,
`lr-scale`); the store calls `decide` and never branches on the policy's kind.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from asyncps.codec import Array


@dataclass(frozen=True)
class Decision:
    """What to do with one gradient: apply it (with the learning rate scaled) or drop it."""

    accept: bool
    lr_scale: float = 1.0
    reason: str = ""


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
            return Decision(False, reason=f"staleness {staleness} > {self.bound}")
        return Decision(True)


class LrScale(StalenessPolicy):
    """Staleness-aware learning rate alpha / max(1, tau) (Zhang et al. 2016)."""

    spec = "lr-scale"

    def decide(self, staleness: int) -> Decision:
        """Apply with the learning rate divided by max(1, staleness)."""
        return Decision(True, lr_scale=1.0 / max(1, staleness))


def parse_policy(spec: str) -> StalenessPolicy:
    """Build a policy from its spec; an unknown spec is a ValueError naming the valid ones."""
    name, _, arg = spec.partition(":")
    if name == "none" and not arg:
        return ApplyAll()
    if name == "lr-scale" and not arg:
        return LrScale()
    if name == "drop":
        try:
            bound = int(arg)
        except ValueError:
            raise ValueError(f"staleness policy {spec!r}: drop needs an integer bound, e.g. drop:4") from None
        if bound < 0:
            raise ValueError(f"staleness policy {spec!r}: the bound must be >= 0")
        return DropAbove(bound)
    raise ValueError(f"unknown staleness policy {spec!r}; valid: none, drop:K, lr-scale")
