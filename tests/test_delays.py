"""Seeded delay injection: spec parsing, determinism, straggler arithmetic and sample statistics."""

from __future__ import annotations

import math
from typing import Any

import pytest

from asyncps.delays import (
    ConstantDelay,
    ExponentialDelay,
    NoDelay,
    StepDelay,
    UniformDelay,
    parse_delay,
    parse_slowdown,
    parse_stragglers,
)

DRAWS = 10_000


# --- parse_delay (existing API) ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "kind"),
    [("none", NoDelay), ("const:0.25", ConstantDelay), ("uniform:0,0.1", UniformDelay), ("exp:0.05", ExponentialDelay)],
)
def test_parse_delay_valid(spec: str, kind: type) -> None:
    assert isinstance(parse_delay(spec, seed=1), kind)


@pytest.mark.parametrize(
    "spec", ["", "none:1", "const", "const:-1", "const:nan", "const:inf", "uniform:2,1", "uniform:1", "exp:0",
             "exp:a", "gauss:1"],
)
def test_parse_delay_invalid(spec: str) -> None:
    with pytest.raises(ValueError, match="compute delay"):
        parse_delay(spec, seed=1)


# --- parse_stragglers -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("", {}),
        ("  ", {}),
        ("0:4x", {0: 4.0}),
        ("0:4x,3:2.5x", {0: 4.0, 3: 2.5}),
        (" 1:1x , 2:3 ", {1: 1.0, 2: 3.0}),
    ],
)
def test_parse_stragglers_valid(spec: str, expected: dict[int, float]) -> None:
    assert parse_stragglers(spec) == expected


@pytest.mark.parametrize(
    "spec", ["0", "0:", ":4x", "-1:4x", "a:4x", "0:0.5x", "0:inf", "0:nanx", "0:4xx", "0:4x,", "0:4x,0:2x",
             "0:4x;1:2x", "0:4x:1"],
)
def test_parse_stragglers_invalid(spec: str) -> None:
    with pytest.raises(ValueError, match="INDEX:FACTOR"):
        parse_stragglers(spec)


# --- parse_slowdown ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [("", (0.0, 1.0)), ("0.1:3", (0.1, 3.0)), ("0.1:3x", (0.1, 3.0)), ("0:1x", (0.0, 1.0)), ("1:2.5x", (1.0, 2.5))],
)
def test_parse_slowdown_valid(spec: str, expected: tuple[float, float]) -> None:
    assert parse_slowdown(spec) == expected


@pytest.mark.parametrize(
    "spec", ["0.1", "0.1:", ":3x", "1.5:3x", "-0.1:3x", "nan:3x", "0.1:0.5x", "0.1:infx", "a:3x", "0.1:3x:1"],
)
def test_parse_slowdown_invalid(spec: str) -> None:
    with pytest.raises(ValueError, match="P:F"):
        parse_slowdown(spec)


# --- StepDelay --------------------------------------------------------------------------------


def _sequence(delay: StepDelay, steps: int = 200) -> list[float]:
    return [delay.extra_compute_s(0.01) for _ in range(steps)]


def _worker(index: int, seed: int = 7, compute: str = "exp:0.05") -> StepDelay:
    return StepDelay.for_worker(index, compute, "1:2x", "0.3:4x", rpc_latency_s=0.0, seed=seed)


def test_same_seed_and_index_give_the_same_sequence() -> None:
    assert _sequence(_worker(0)) == _sequence(_worker(0))


def test_other_index_or_seed_gives_another_sequence() -> None:
    first = _sequence(_worker(0))
    assert _sequence(_worker(2)) != first
    assert _sequence(_worker(0, seed=8)) != first


def test_slowdown_pattern_is_independent_of_the_base_distribution() -> None:
    # Its own RNG: the same steps are slowed whatever base delay is drawn.
    a, b = _worker(0, compute="none"), _worker(0, compute="uniform:0,0.001")
    slowed_a = [a.extra_compute_s(1.0) > 2.0 for _ in range(500)]
    slowed_b = [b.extra_compute_s(1.0) > 2.0 for _ in range(500)]
    assert slowed_a == slowed_b
    assert any(slowed_a) and not all(slowed_a)


@pytest.mark.parametrize("measured", [0.0, 0.001, 0.0173, 0.25, 1.0, 3.7])
def test_straggler_4x_without_base_delay_adds_three_times_the_measured_time(measured: float) -> None:
    delay = StepDelay.for_worker(0, "none", "0:4x,3:2.5x", "", rpc_latency_s=0.0, seed=3)
    assert delay.slow_factor == 4.0
    for _ in range(20):
        assert delay.extra_compute_s(measured) == 3 * measured


def test_worker_not_listed_as_straggler_runs_at_full_speed() -> None:
    delay = StepDelay.for_worker(1, "none", "0:4x,3:2.5x", "", rpc_latency_s=0.0, seed=3)
    assert delay.slow_factor == 1.0
    assert delay.extra_compute_s(0.5) == 0.0


def test_factor_scales_the_base_delay_too() -> None:
    delay = StepDelay(ConstantDelay(0.5), slow_factor=2.0)
    assert delay.extra_compute_s(1.0) == pytest.approx((1.0 + 0.5) * 2.0 - 1.0)


def test_certain_slowdown_multiplies_with_the_straggler_factor() -> None:
    delay = StepDelay(NoDelay(), slow_factor=2.0, slowdown_p=1.0, slowdown_factor=3.0)
    assert delay.extra_compute_s(1.0) == pytest.approx(5.0)


def test_slowdown_frequency_is_within_binomial_tolerance() -> None:
    p = 0.1
    delay = StepDelay(NoDelay(), slowdown_p=p, slowdown_factor=2.0, seed=11)
    slowed = sum(delay.extra_compute_s(1.0) == 1.0 for _ in range(DRAWS))
    sd = math.sqrt(DRAWS * p * (1 - p))
    assert abs(slowed - DRAWS * p) <= 5 * sd


def test_exponential_mean_within_tolerance() -> None:
    mean = 0.05
    delay = StepDelay.for_worker(0, f"exp:{mean}", "", "", rpc_latency_s=0.0, seed=5)
    draws = [delay.extra_compute_s(0.0) for _ in range(DRAWS)]
    assert min(draws) >= 0.0
    assert abs(sum(draws) / DRAWS - mean) <= 5 * mean / math.sqrt(DRAWS)


def test_uniform_mean_and_range_within_tolerance() -> None:
    low, high = 0.02, 0.08
    delay = StepDelay.for_worker(0, f"uniform:{low},{high}", "", "", rpc_latency_s=0.0, seed=5)
    draws = [delay.extra_compute_s(0.0) for _ in range(DRAWS)]
    assert low <= min(draws) and max(draws) <= high
    sd_of_mean = (high - low) / math.sqrt(12 * DRAWS)
    assert abs(sum(draws) / DRAWS - (low + high) / 2) <= 5 * sd_of_mean


def test_rpc_latency_is_stored_and_described() -> None:
    delay = StepDelay.for_worker(0, "const:0.01", "0:4x", "0.2:3x", rpc_latency_s=0.005, seed=1)
    assert delay.rpc_latency_s == 0.005
    assert delay.describe() == "compute=const:0.01 straggler=4x slowdown=0.2:3x rpc_latency=0.005s"


@pytest.mark.parametrize(
    "kwargs",
    [{"slow_factor": 0.5}, {"slow_factor": math.inf}, {"slowdown_p": 1.5}, {"slowdown_p": math.nan},
     {"slowdown_factor": 0.9}, {"rpc_latency_s": -0.001}, {"rpc_latency_s": math.nan}],
)
def test_step_delay_rejects_bad_parameters(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        StepDelay(NoDelay(), **kwargs)


@pytest.mark.parametrize("measured", [-0.1, math.nan, math.inf])
def test_extra_compute_rejects_bad_measurements(measured: float) -> None:
    with pytest.raises(ValueError, match="measured_compute_s"):
        StepDelay(NoDelay()).extra_compute_s(measured)


def test_for_worker_rejects_bad_specs_and_index() -> None:
    with pytest.raises(ValueError, match="compute delay"):
        StepDelay.for_worker(0, "gauss:1", "", "", 0.0, seed=1)
    with pytest.raises(ValueError, match="stragglers"):
        StepDelay.for_worker(0, "none", "0:0.5x", "", 0.0, seed=1)
    with pytest.raises(ValueError, match="slowdown"):
        StepDelay.for_worker(0, "none", "", "2:3x", 0.0, seed=1)
    with pytest.raises(ValueError, match="worker index"):
        StepDelay.for_worker(-1, "none", "", "", 0.0, seed=1)
