"""asyncps.rules.policies and the validation of UpdateRuleConfig."""

from __future__ import annotations

import pytest

from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.rules.drops import DropReason
from asyncps.rules.policies import ApplyAll, Decision, DropAbove, LrScale, parse_policy


@pytest.mark.parametrize(
    "spec, policy",
    [("none", ApplyAll), ("lr-scale", LrScale), ("drop:bound=0", DropAbove), ("drop:bound=4", DropAbove)],
)
def test_parse_policy_round_trips_its_spec(spec: str, policy: type) -> None:
    parsed = parse_policy(spec)
    assert isinstance(parsed, policy)
    assert parsed.spec == spec
    assert parse_policy(spec.replace("bound=", "")) == parsed  # the older positional spelling


@pytest.mark.parametrize(
    "spec, message",
    [("", "unknown staleness policy"), ("drop", "needs bound=INT"), ("drop:x", "bound must be an integer"),
     ("drop:-1", ">= 0"), ("none:1", "takes no parameters"), ("lr-scale:2", "takes no parameters"),
     ("bogus", "unknown")],
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
    [({"mode": "bogus"}, "unknown consistency mode"), ({"staleness_policy": "drop:"}, "bound needs a value"),
     ({"num_workers": 0}, "num_workers"), ({"mode": "sync:backup=-1"}, "backup must be an integer >= 0"),
     ({"mode": "ssp:bound=-1"}, "bound must be an integer >= 0")],
)
def test_update_rule_config_is_validated_once(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        UpdateRuleConfig(OptimizerConfig("sgd", 0.1), **kwargs)
