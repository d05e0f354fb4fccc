"""asyncps.rules.policies: each staleness policy against a hand-computed case, its state, and parse_policy."""

from __future__ import annotations

import numpy as np
import pytest

from asyncps.rules.drops import DropReason
from asyncps.rules.policies import (
    AdaptiveDelayCompensated,
    ApplyAll,
    Decision,
    DelayCompensated,
    DropAbove,
    GapAware,
    LrScale,
    StalenessPolicy,
    parse_policy,
)


def f32(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def close(actual: np.ndarray, expected: np.ndarray, rtol: float = 1e-6) -> None:
    assert actual.dtype == np.float32
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=1e-7)


# -- decisions ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bound", [0, 2])
def test_drop_above_applies_up_to_the_bound_and_drops_beyond(bound: int) -> None:
    policy = DropAbove(bound)
    assert [policy.decide(s).accept for s in range(bound + 3)] == [True] * (bound + 1) + [False, False]
    assert policy.decide(bound + 1) == Decision(False, 1.0, f"staleness {bound + 1} > {bound}", DropReason.STALE)


def test_lr_scale_matches_one_over_max_one_staleness() -> None:
    # By hand: 1/max(1, 0) = 1, 1/max(1, 1) = 1, 1/3 = 0.333.., 1/8 = 0.125.
    assert [LrScale().decide(s).lr_scale for s in (0, 1, 3, 8)] == pytest.approx([1.0, 1.0, 1 / 3, 0.125])
    assert all(LrScale().decide(s).accept for s in (0, 1, 3, 8))


@pytest.mark.parametrize("policy", [DelayCompensated(), AdaptiveDelayCompensated(), GapAware(), GapAware(0.5)])
def test_gradient_corrections_accept_everything_at_full_rate(policy: StalenessPolicy) -> None:
    assert policy.needs_read_values
    assert [policy.decide(s) for s in (0, 1, 50)] == [Decision(True, 1.0, "")] * 3


def test_decision_policies_do_not_need_read_values() -> None:
    assert not any(p.needs_read_values for p in (ApplyAll(), DropAbove(1), LrScale()))


# -- dc-asgd -----------------------------------------------------------------------------------


def test_dc_asgd_matches_its_formula() -> None:
    # lambda = 0.5, g = [1, -2, 3], w_now - w_read = [1 - 0.5, 2 - 2.5, 3 - 3] = [0.5, -0.5, 0]
    # g*g = [1, 4, 9]; lambda*g*g*gap = 0.5*[0.5, -2, 0] = [0.25, -1, 0]; g_dc = [1.25, -3, 3]
    adjusted = DelayCompensated(0.5).adjust("w", f32(1, -2, 3), f32(1, 2, 3), f32(0.5, 2.5, 3), {})
    close(adjusted, f32(1.25, -3, 3))


def test_dc_asgd_default_lambda_is_0_04() -> None:
    # 0.04 * [1, 4, 9] * [0.5, -0.5, 0] = [0.02, -0.08, 0]; g_dc = [1.02, -2.08, 3]
    adjusted = DelayCompensated().adjust("w", f32(1, -2, 3), f32(1, 2, 3), f32(0.5, 2.5, 3), {})
    close(adjusted, f32(1.02, -2.08, 3))


def test_dc_asgd_with_zero_lambda_leaves_the_gradient_unchanged() -> None:
    grad = f32(0.3, -7, 1e-3)
    np.testing.assert_array_equal(DelayCompensated(0.0).adjust("w", grad, f32(5, 6, 7), f32(-1, 0, 1), {}), grad)


# -- dc-asgd-a ---------------------------------------------------------------------------------


def test_dc_asgd_adaptive_matches_its_formula_and_evolves_its_mean_square() -> None:
    policy = AdaptiveDelayCompensated(1.0, 0.75)
    state: dict[str, np.ndarray] = {}
    # Call 1: g = [2, -4, 1], ms = 0.75*0 + 0.25*g*g = [1, 4, 0.25]; lambda = 1/sqrt(ms) = [1, 0.5, 2]
    # (eps = 1e-7 shifts these by < 1e-6 relative). gap = [0.5, 0.25, -1];
    # lambda*g*g*gap = [1*4*0.5, 0.5*16*0.25, 2*1*(-1)] = [2, 2, -2]; g_dc = [4, -2, -1]
    first = policy.adjust("w", f32(2, -4, 1), f32(1.5, 1.25, -1), f32(1, 1, 0), state)
    close(first, f32(4, -2, -1))
    close(state["mean_square"], f32(1, 4, 0.25))
    # Call 2: g = [0, 4, 1], ms = 0.75*[1, 4, 0.25] + 0.25*[0, 16, 1] = [0.75, 7, 0.4375];
    # gap = [1, 0.5, 0]; correction = [0, 16*0.5/sqrt(7), 0] = [0, 3.0237158, 0]; g_dc = [0, 7.0237158, 1]
    second = policy.adjust("w", f32(0, 4, 1), f32(2, 0.5, 3), f32(1, 0, 3), state)
    close(second, f32(0, 7.0237158, 1))
    close(state["mean_square"], f32(0.75, 7, 0.4375))


def test_dc_asgd_adaptive_defaults_are_the_papers() -> None:
    policy = AdaptiveDelayCompensated()
    assert (policy.variance_control, policy.momentum) == (2.0, 0.95)
    state: dict[str, np.ndarray] = {}
    # g = [2], ms = 0.05*4 = 0.2; lambda = 2/sqrt(0.2) = 4.472136; gap = 0.1; g_dc = 2 + 4.472136*4*0.1 = 3.7888544
    close(policy.adjust("w", f32(2), f32(0.1), f32(0), state), f32(3.7888544))
    close(state["mean_square"], f32(0.2))


# -- gap-aware ---------------------------------------------------------------------------------


def test_gap_aware_with_a_constant_matches_its_formula() -> None:
    # C = 0.5, gap = |[1.5, 0, 2] - [1, 1, 2]| = [0.5, 1, 0]; G = 1 + gap/C = [2, 3, 1]; g/G = [1, -1, 4]
    adjusted = GapAware(0.5).adjust("w", f32(2, -3, 4), f32(1.5, 0, 2), f32(1, 1, 2), {})
    close(adjusted, f32(1, -1, 4))


def test_gap_aware_estimates_the_step_as_a_moving_average_of_consecutive_values() -> None:
    policy = GapAware()
    state: dict[str, np.ndarray] = {}
    grad, read = f32(1, 1, 1), f32(0, 0, 0)
    # Call 1: no step observed yet, so no scale to measure the gap in: g unchanged.
    close(policy.adjust("w", grad, f32(0, 0, 0), read, state), grad)
    # Call 2: step = |[0.1, -0.2, 0] - [0, 0, 0]| = [0.1, 0.2, 0]; C = max(step, 1e-8);
    # gap = [0.1, 0.2, 0]; G = [2, 2, 1]; g/G = [0.5, 0.5, 1]
    close(policy.adjust("w", grad, f32(0.1, -0.2, 0), read, state), f32(0.5, 0.5, 1))
    close(state["step_size"], f32(0.1, 0.2, 0))
    # Call 3: step = |[0.4, -0.2, 0] - [0.1, -0.2, 0]| = [0.3, 0, 0];
    # C = 0.9*[0.1, 0.2, 0] + 0.1*[0.3, 0, 0] = [0.12, 0.18, 0]; gap = [0.4, 0.2, 0];
    # G = [1 + 10/3, 1 + 10/9, 1] = [13/3, 19/9, 1]; g/G = [3/13, 9/19, 1] = [0.2307692, 0.4736842, 1]
    close(policy.adjust("w", grad, f32(0.4, -0.2, 0), read, state), f32(0.2307692, 0.4736842, 1))
    close(state["step_size"], f32(0.12, 0.18, 0))
    close(state["previous_value"], f32(0.4, -0.2, 0))


def test_gap_aware_floors_the_step_so_an_element_that_never_moved_is_not_divided_by_zero() -> None:
    policy, state = GapAware(), {}
    policy.adjust("w", f32(1, 1), f32(0, 0), f32(0, 0), state)
    # Element 1 never moved (step 0 -> floor 1e-8) but its gap is 1e-3: G = 1 + 1e5, g ~ 1e-5, finite.
    adjusted = policy.adjust("w", f32(1, 1), f32(0.1, 0), f32(0, -1e-3), state)
    assert np.all(np.isfinite(adjusted))
    close(adjusted, f32(0.5, 1 / (1 + 1e5)), rtol=1e-5)


def test_gap_aware_restarts_its_estimate_when_the_shape_changes() -> None:
    policy, state = GapAware(), {}
    policy.adjust("w", f32(1, 1), f32(0, 0), f32(0, 0), state)
    policy.adjust("w", f32(1, 1), f32(1, 1), f32(0, 0), state)
    grad = f32(1, 2, 3)
    np.testing.assert_array_equal(policy.adjust("w", grad, f32(5, 5, 5), f32(0, 0, 0), state), grad)
    assert "step_size" not in state


@pytest.mark.parametrize("policy", [GapAware(), GapAware(0.5), GapAware(1e-6)])
def test_gap_aware_without_a_gap_leaves_the_gradient_unchanged(policy: GapAware) -> None:
    state: dict[str, np.ndarray] = {}
    grad = f32(0.3, -7, 1e-3)
    for now in (f32(1, 2, 3), f32(1.5, 2, 2), f32(0, 0, 0)):
        np.testing.assert_array_equal(policy.adjust("w", grad, now, now.copy(), state), grad)


# -- the contract every correcting policy keeps --------------------------------------------------

CORRECTIONS = [
    DelayCompensated(),
    DelayCompensated(0.5),
    AdaptiveDelayCompensated(),
    AdaptiveDelayCompensated(1.0, 0.5),
    GapAware(),
    GapAware(0.01),
]


@pytest.mark.parametrize("policy", CORRECTIONS, ids=lambda p: p.spec)
def test_adjust_never_modifies_its_inputs(policy: StalenessPolicy) -> None:
    rng = np.random.default_rng(0)
    grad, now, read = (rng.normal(size=(4, 3)).astype(np.float32) for _ in range(3))
    copies = [a.copy() for a in (grad, now, read)]
    state: dict[str, np.ndarray] = {}
    for _ in range(3):
        adjusted = policy.adjust("w", grad, now, read, state)
        assert adjusted is not grad and not np.shares_memory(adjusted, grad)
        now += np.float32(0.01)  # the store updates its values in place between calls
        copies[1] += np.float32(0.01)
    for array, copy in zip((grad, now, read), copies, strict=True):
        np.testing.assert_array_equal(array, copy)
    # State must not alias the live values: the store changes them in place after the call.
    assert not any(np.shares_memory(s, now) for s in state.values())


@pytest.mark.parametrize("policy", CORRECTIONS, ids=lambda p: p.spec)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_adjust_keeps_the_gradients_dtype_and_shape(policy: StalenessPolicy, dtype: type) -> None:
    grad = np.full((2, 3), 0.5, dtype=dtype)
    state: dict[str, np.ndarray] = {}
    for step in range(3):
        now = np.full((2, 3), 0.1 * step, dtype=dtype)
        adjusted = policy.adjust("w", grad, now, np.zeros((2, 3), dtype=dtype), state)
        assert adjusted.dtype == dtype and adjusted.shape == grad.shape
        assert all(s.dtype == dtype for s in state.values())


def test_adjust_computes_in_float32_even_with_float64_values() -> None:
    adjusted = DelayCompensated(0.5).adjust("w", f32(1, -2, 3), np.array([1.0, 2, 3]), np.array([0.5, 2.5, 3]), {})
    close(adjusted, f32(1.25, -3, 3))


# -- parse_policy ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("none", ApplyAll()),
        ("lr-scale", LrScale()),
        ("drop:bound=3", DropAbove(3)),
        ("dc-asgd", DelayCompensated(0.04)),
        ("dc-asgd:lambda=0.1", DelayCompensated(0.1)),
        ("dc-asgd:lambda=0", DelayCompensated(0.0)),
        ("dc-asgd-a", AdaptiveDelayCompensated(2.0, 0.95)),
        ("dc-asgd-a:lambda0=3", AdaptiveDelayCompensated(3.0, 0.95)),
        ("dc-asgd-a:lambda0=3,momentum=0.9", AdaptiveDelayCompensated(3.0, 0.9)),
        ("dc-asgd-a:momentum=0.9", AdaptiveDelayCompensated(2.0, 0.9)),
        ("gap-aware", GapAware(None)),
        ("gap-aware:c=0.001", GapAware(0.001)),
        ("gap-aware:c=1e-05", GapAware(1e-5)),
    ],
)
def test_parse_policy_round_trips_canonical_specs(spec: str, expected: StalenessPolicy) -> None:
    parsed = parse_policy(spec)
    assert type(parsed) is type(expected) and parsed.spec == spec
    if not isinstance(expected, (ApplyAll, LrScale)):
        assert parsed == expected
    assert parse_policy(parsed.spec).spec == spec


@pytest.mark.parametrize(
    "spec, canonical",
    [("dc-asgd:0.04", "dc-asgd"), ("dc-asgd:1.0", "dc-asgd:lambda=1"), ("dc-asgd-a:2.0,0.95", "dc-asgd-a"),
     ("dc-asgd-a:5,0.95", "dc-asgd-a:lambda0=5"), ("gap-aware:2.50", "gap-aware:c=2.5"),
     ("dc-asgd-a:2,0.9", "dc-asgd-a:momentum=0.9"), ("drop:3", "drop:bound=3"),
     ("dc-asgd-a:momentum=0.9,lambda0=2", "dc-asgd-a:momentum=0.9")],
)
def test_parse_policy_writes_defaults_out_of_the_canonical_spec(spec: str, canonical: str) -> None:
    assert parse_policy(spec).spec == canonical
    assert parse_policy(canonical) == parse_policy(spec)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("dc-asgd:abc", "lambda must be a number"),
        ("dc-asgd:lambda=abc", "lambda must be a number"),
        ("dc-asgd:", "lambda needs a value"),
        ("dc-asgd:-0.1", "lambda must be a finite number >= 0"),
        ("dc-asgd:nan", "lambda must be a finite number"),
        ("dc-asgd:0.1,2", "at most 1 positional"),
        ("dc-asgd:lambda=0.1,lambda=0.2", "lambda given twice"),
        ("dc-asgd:beta=0.1", "unknown key 'beta'; dc-asgd takes: lambda"),
        ("dc-asgd:lambda=0.1,0.2", "a value without a key"),
        ("dc-asgd-a:1,2,3", "at most 2 positional"),
        ("dc-asgd-a:1,", "momentum needs a value"),
        ("dc-asgd-a:1,1", r"momentum must be in \[0, 1\)"),
        ("dc-asgd-a:-2", "lambda0 must be a finite number >= 0"),
        ("gap-aware:-1", "c must be a finite number >= 0"),
        ("gap-aware:0", "c must be > 0"),
        ("gap-aware:c=inf", "c must be a finite number"),
        ("gap-aware:x", "c must be a number"),
        ("drop:x", "bound must be an integer"),
        ("drop:bound=1.5", "bound must be an integer"),
        ("drop:-1", ">= 0"),
        ("drop", "drop needs bound=INT"),
        ("none:1", "none takes no parameters"),
        ("lr-scale:", "lr-scale takes no parameters"),
    ],
)
def test_parse_policy_rejects_malformed_specs_naming_the_valid_forms(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        parse_policy(spec)
    assert f"staleness policy {spec!r}" in str(error.value)
    assert f"valid: {spec.partition(':')[0]}" in str(error.value)  # the entry's valid form


@pytest.mark.parametrize("spec", ["dcasgd", "", "DROP:3", "drop :3", " none"])
def test_parse_policy_names_every_policy_for_an_unknown_name(spec: str) -> None:
    with pytest.raises(ValueError, match="unknown staleness policy") as error:
        parse_policy(spec)
    assert "dc-asgd[:lambda=FLOAT] | dc-asgd-a[:lambda0=FLOAT,momentum=FLOAT] | gap-aware[:c=FLOAT]" in str(error.value)


def test_policies_validate_when_built_directly() -> None:
    with pytest.raises(ValueError, match="c must be > 0"):
        GapAware(0.0)
    with pytest.raises(ValueError, match="momentum"):
        AdaptiveDelayCompensated(2.0, 1.5)
