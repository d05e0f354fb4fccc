"""Seeded delay injection for staleness experiments: compute delays, stragglers, slowdowns, RPC latency."""

from __future__ import annotations

import abc
import hashlib
import math
import random
import re


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
    if any(not math.isfinite(n) or n < 0 for n in numbers):
        raise ValueError(f"compute delay {spec!r}: seconds must be finite and >= 0")
    if kind == "none" and not numbers:
        return NoDelay()
    if kind == "const" and len(numbers) == 1:
        return ConstantDelay(numbers[0])
    if kind == "uniform" and len(numbers) == 2 and numbers[0] <= numbers[1]:
        return UniformDelay(numbers[0], numbers[1], rng)
    if kind == "exp" and len(numbers) == 1 and numbers[0] > 0:
        return ExponentialDelay(numbers[0], rng)
    raise ValueError(f"bad compute delay {spec!r}; valid: none, const:S, uniform:A,B (A<=B), exp:MEAN")


_STRAGGLERS_FORM = "comma-separated INDEX:FACTORx, e.g. '0:4x' or '0:4x,3:2.5x' (FACTOR >= 1)"
_SLOWDOWN_FORM = "P:F or P:Fx, e.g. '0.1:3x' (0 <= P <= 1, F >= 1)"
_STRAGGLER_ITEM = re.compile(r"(\d+):([^:x]+)x?")
_SLOWDOWN_SPEC = re.compile(r"([^:]+):([^:x]+)x?")


def _parse_factor(text: str) -> float | None:
    """A finite slow factor >= 1 from `text`, or None when it is not one."""
    try:
        factor = float(text)
    except ValueError:
        return None
    return factor if math.isfinite(factor) and factor >= 1.0 else None


def parse_stragglers(spec: str) -> dict[int, float]:
    """Map worker index to permanent slow factor from `INDEX:FACTORx[,...]`; empty spec means none."""
    stragglers: dict[int, float] = {}
    if not spec.strip():
        return stragglers
    for item in spec.split(","):
        match = _STRAGGLER_ITEM.fullmatch(item.strip())
        factor = _parse_factor(match.group(2)) if match else None
        if match is None or factor is None:
            raise ValueError(f"bad stragglers {spec!r} at {item.strip()!r}; valid: {_STRAGGLERS_FORM}")
        index = int(match.group(1))
        if index in stragglers:
            raise ValueError(f"bad stragglers {spec!r}: worker {index} listed twice; valid: {_STRAGGLERS_FORM}")
        stragglers[index] = factor
    return stragglers


def parse_slowdown(spec: str) -> tuple[float, float]:
    """(probability, factor) of a random per-step slowdown from `P:F` or `P:Fx`; empty spec means none."""
    if not spec.strip():
        return 0.0, 1.0
    match = _SLOWDOWN_SPEC.fullmatch(spec.strip())
    factor = _parse_factor(match.group(2)) if match else None
    try:
        probability = float(match.group(1)) if match else math.nan
    except ValueError:
        probability = math.nan
    if factor is None or not 0.0 <= probability <= 1.0:  # NaN fails the range check too
        raise ValueError(f"bad slowdown {spec!r}; valid: {_SLOWDOWN_FORM}")
    return probability, factor


def _stream_seed(seed: int, index: int, stream: str) -> int:
    """A seed for one worker's random stream, stable across processes (hashlib, never hash())."""
    digest = hashlib.sha256(f"asyncps.delays/{stream}/{seed}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


class StepDelay:
    """One worker's injected delays: base compute delay, straggler factor, random slowdowns, RPC latency.

    A step's compute time becomes (measured + base delay) x slow_factor x (slowdown_factor when
    the step is randomly slowed, else 1). The slowdown coin is flipped exactly once per step from
    its own RNG, so the pattern of slowed steps does not depend on the base distribution.
    """

    def __init__(
        self,
        compute: ComputeDelay,
        slow_factor: float = 1.0,
        slowdown_p: float = 0.0,
        slowdown_factor: float = 1.0,
        rpc_latency_s: float = 0.0,
        seed: int = 0,
    ) -> None:
        if not (math.isfinite(slow_factor) and slow_factor >= 1.0):
            raise ValueError(f"slow_factor must be finite and >= 1, got {slow_factor}")
        if not 0.0 <= slowdown_p <= 1.0:
            raise ValueError(f"slowdown_p must be in [0, 1], got {slowdown_p}")
        if not (math.isfinite(slowdown_factor) and slowdown_factor >= 1.0):
            raise ValueError(f"slowdown_factor must be finite and >= 1, got {slowdown_factor}")
        if not (math.isfinite(rpc_latency_s) and rpc_latency_s >= 0.0):
            raise ValueError(f"rpc_latency_s must be finite and >= 0, got {rpc_latency_s}")
        self.compute = compute
        self.slow_factor = slow_factor
        self.slowdown_p = slowdown_p
        self.slowdown_factor = slowdown_factor
        self.rpc_latency_s = rpc_latency_s
        self._slowdown_rng = random.Random(seed)

    @classmethod
    def for_worker(
        cls, index: int, compute_delay: str, stragglers: str, slowdown: str, rpc_latency_s: float, seed: int
    ) -> StepDelay:
        """Parse the run's delay specs and build worker `index`'s delays, seeded from (seed, index)."""
        if index < 0:
            raise ValueError(f"worker index must be >= 0, got {index}")
        slowdown_p, slowdown_factor = parse_slowdown(slowdown)
        return cls(
            compute=parse_delay(compute_delay, _stream_seed(seed, index, "compute")),
            slow_factor=parse_stragglers(stragglers).get(index, 1.0),
            slowdown_p=slowdown_p,
            slowdown_factor=slowdown_factor,
            rpc_latency_s=rpc_latency_s,
            seed=_stream_seed(seed, index, "slowdown"),
        )

    def extra_compute_s(self, measured_compute_s: float) -> float:
        """Seconds to sleep after a real gradient computation that took `measured_compute_s`."""
        if not (math.isfinite(measured_compute_s) and measured_compute_s >= 0.0):
            raise ValueError(f"measured_compute_s must be finite and >= 0, got {measured_compute_s}")
        slowed = self._slowdown_rng.random() < self.slowdown_p  # drawn every step to keep the stream aligned
        factor = self.slow_factor * (self.slowdown_factor if slowed else 1.0)
        base = self.compute.sample()
        # Same as (measured + base) * factor - measured, without cancelling the measured time away.
        return measured_compute_s * (factor - 1.0) + base * factor

    def describe(self) -> str:
        """A one-line summary for logs."""
        return (
            f"compute={self.compute.spec} straggler={self.slow_factor:g}x "
            f"slowdown={self.slowdown_p:g}:{self.slowdown_factor:g}x rpc_latency={self.rpc_latency_s:g}s"
        )
