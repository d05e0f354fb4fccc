"""Seeded compute-delay injection for staleness experiments (extra seconds added to a step)."""

from __future__ import annotations

import abc
import random


class ComputeDelay(abc.ABC):
    """A source of extra per-step compute time."""

    spec: str

    @abc.abstractmethod
    def sample(self) -> float:
        """Seconds to add to the next step."""


class NoDelay(ComputeDelay):
    """No injected delay."""

    spec = "none"

    def sample(self) -> float:
        """Always zero."""
        return 0.0


class ConstantDelay(ComputeDelay):
    """The same delay every step."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.spec = f"const:{seconds}"

    def sample(self) -> float:
        """The constant."""
        return self.seconds


class UniformDelay(ComputeDelay):
    """A delay drawn uniformly from [low, high]."""

    def __init__(self, low: float, high: float, rng: random.Random) -> None:
        self.low, self.high, self._rng = low, high, rng
        self.spec = f"uniform:{low},{high}"

    def sample(self) -> float:
        """A uniform draw."""
        return self._rng.uniform(self.low, self.high)


class ExponentialDelay(ComputeDelay):
    """A delay drawn from an exponential distribution with the given mean."""

    def __init__(self, mean: float, rng: random.Random) -> None:
        self.mean, self._rng = mean, rng
        self.spec = f"exp:{mean}"

    def sample(self) -> float:
        """An exponential draw."""
        return self._rng.expovariate(1.0 / self.mean)


def parse_delay(spec: str, seed: int) -> ComputeDelay:
    """Build a delay from `none`, `const:S`, `uniform:A,B` or `exp:MEAN` (seconds), seeded."""
    kind, _, arg = spec.partition(":")
    rng = random.Random(seed)
    try:
        numbers = [float(x) for x in arg.split(",")] if arg else []
    except ValueError:
        raise ValueError(f"compute delay {spec!r}: arguments must be numbers") from None
    if any(n < 0 for n in numbers):
        raise ValueError(f"compute delay {spec!r}: seconds must be >= 0")
    if kind == "none" and not numbers:
        return NoDelay()
    if kind == "const" and len(numbers) == 1:
        return ConstantDelay(numbers[0])
    if kind == "uniform" and len(numbers) == 2 and numbers[0] <= numbers[1]:
        return UniformDelay(numbers[0], numbers[1], rng)
    if kind == "exp" and len(numbers) == 1 and numbers[0] > 0:
        return ExponentialDelay(numbers[0], rng)
    raise ValueError(f"bad compute delay {spec!r}; valid: none, const:S, uniform:A,B (A<=B), exp:MEAN")
