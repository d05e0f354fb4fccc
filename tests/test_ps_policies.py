"""asyncps.rules.policies and the validation of UpdateRuleConfig."""

from __future__ import annotations

import pytest

from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.rules.drops import DropReason
from asyncps.rules.policies import ApplyAll, Decision, DropAbove, LrScale, parse_policy


@pytest.mark.parametrize(
    "spec, policy",
    [("none", ApplyAll), ("lr-scale", LrScale), ("drop:0", DropAbove), ("drop:4", DropAbove)],
)
def test_parse_policy_round_trips_its_spec(spec: str, policy: type) -> None:
    parsed = parse_policy(spec)
    assert isinstance(parsed, policy)
    assert parsed.spec == spec


@pytest.mark.parametrize(
    "spec, message",
    [("", "unknown staleness policy"), ("drop", "integer bound"), ("drop:x", "integer bound"),
     ("drop:-1", ">= 0"), ("none:1", "unknown"), ("lr-scale:2", "unknown"), ("bogus", "unknown")],
)
def test_parse_policy_rejects_bad_specs(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_policy(spec)


@pytest.mark.parametrize("staleness", [0, 1, 5, 1000])
def test_apply_all_always_applies_at_full_rate(staleness: int) -> None:
    assert ApplyAll().decide(staleness) == Decision(True, 1.0, "")


@pytest.mark.parametrize("bound", [0, 1, 3])
def test_drop_above_accepts_up_to_and_including_the_bound(bound: int) -> None:
    policy = DropAbove(bound)
    for staleness in range(bound + 1):
        assert policy.decide(staleness) == Decision(True, 1.0, "")
    for staleness in (bound + 1, bound + 7):
        assert policy.decide(staleness) == Decision(False, 1.0, f"staleness {staleness} > {bound}", DropReason.STALE)


@pytest.mark.parametrize("staleness, scale", [(0, 1.0), (1, 1.0), (2, 0.5), (4, 0.25), (10, 0.1)])
def test_lr_scale_divides_by_staleness(staleness: int, scale: float) -> None:
    decision = LrScale().decide(staleness)
    assert decision.accept and decision.lr_scale == pytest.approx(scale, rel=1e-15)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"mode": "bogus"}, "unknown mode"), ({"staleness_policy": "drop:"}, "integer bound"),
     ({"num_workers": 0}, "num_workers"), ({"backup_workers": -1}, "backup_workers"),
     ({"staleness_bound": -1}, "staleness_bound")],
)
def test_update_rule_config_is_validated_once(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        UpdateRuleConfig(OptimizerConfig("sgd", 0.1), **kwargs)
