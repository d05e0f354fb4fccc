"""Non-trainable state parts on a shard (UpdateRuleConfig.state): a push carries each one's delta, new
value minus the value read, which the shard adds once per applied push, v += delta, with no optimizer."""

from __future__ import annotations

import numpy as np
import pytest
from asyncps.ps.store import ShardStore

from asyncps.errors import InvalidArgumentError, NonFiniteGradientError
from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.wire.codec import SparseRows
from asyncps.wire.proto import rule_from_proto, rule_to_proto


def rule(optimizer: str = "adam", mode: str = "async", workers: int = 1) -> UpdateRuleConfig:
    return UpdateRuleConfig(OptimizerConfig(optimizer, 0.5), mode=mode, num_workers=workers, state=("mean",))


def values() -> dict[str, np.ndarray]:
    return {"w": np.ones(3, dtype=np.float32), "mean": np.array([1.0, 2.0], dtype=np.float32)}


def make_store(**kwargs: object) -> ShardStore:
    store = ShardStore()
    assert store.initialize(rule(**kwargs), values())  # type: ignore[arg-type]
    return store


def test_state_names_travel_with_the_rule() -> None:
    assert rule_from_proto(rule_to_proto(rule())) == rule()
    assert UpdateRuleConfig(OptimizerConfig("sgd", 0.1), state=("b", "a", "b")).state == ("a", "b")


def test_a_state_part_adds_each_push_delta_with_no_optimizer_and_no_slots() -> None:
    store = make_store()
    snap = store.snapshot()
    assert snap.slots["mean"] == {} and set(snap.slots["w"]) == {"momentum", "velocity"}
    delta = np.array([0.25, -1.0], dtype=np.float32)
    for k in range(3):
        outcome = store.push("w0", k, {"mean": delta, "w": np.ones(3, dtype=np.float32)})
        assert outcome.accepted and outcome.version == k + 1
    np.testing.assert_array_equal(store.values()["mean"], np.array([1.75, -1.0], dtype=np.float32))
    # the trainable part went through adam (lr 0.5: about 0.5 a step), the state part by its deltas only
    assert store.values()["w"][0] < 0
    snap = store.snapshot()
    assert snap.slots["mean"] == {} and snap.updates["mean"] == 3 and snap.version == 3


def test_a_stale_push_still_adds_its_delta_once() -> None:
    store = make_store()
    store.push("w0", 0, {"mean": np.array([1.0, 0.0], dtype=np.float32)})
    store.push("w1", 0, {"mean": np.array([0.0, 1.0], dtype=np.float32)})  # read version 0, one behind
    np.testing.assert_array_equal(store.values()["mean"], np.array([2.0, 3.0], dtype=np.float32))


def test_pulled_state_is_never_changed_under_its_reader() -> None:
    store = make_store()
    pulled = store.pull().values
    assert pulled is not None
    before = pulled["mean"].copy()
    store.push("w0", 0, {"mean": np.array([1.0, 1.0], dtype=np.float32)})
    np.testing.assert_array_equal(pulled["mean"], before)
    np.testing.assert_array_equal(store.values()["mean"], before + 1)


@pytest.mark.parametrize("delta, error", [
    (np.zeros(3, dtype=np.float32), InvalidArgumentError),  # wrong shape
    (np.zeros(2, dtype=np.float64), InvalidArgumentError),  # wrong dtype
    (np.zeros((1, 2), dtype=np.float32), InvalidArgumentError),
    (SparseRows(np.array([0]), np.zeros((1,), dtype=np.float32)), InvalidArgumentError),  # sparse delta
    (np.array([np.nan, 0.0], dtype=np.float32), NonFiniteGradientError),
])
def test_a_bad_delta_is_refused_and_changes_nothing(delta: object, error: type[Exception]) -> None:
    store = make_store()
    before = store.values()
    with pytest.raises(error):
        store.push("w0", 0, {"w": np.ones(3, dtype=np.float32), "mean": delta})  # type: ignore[dict-item]
    after = store.values()
    assert store.version == 0 and store.stats().pushes_accepted == 0
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])


def test_sync_averages_the_workers_deltas_in_one_step() -> None:
    store = make_store(optimizer="sgd", mode="sync", workers=2)
    store.set_live_workers(["a", "b"])
    store.push("a", 0, {"mean": np.array([1.0, 0.0], dtype=np.float32), "w": np.zeros(3, dtype=np.float32)})
    assert store.version == 0
    store.push("b", 0, {"mean": np.array([3.0, 2.0], dtype=np.float32), "w": np.zeros(3, dtype=np.float32)})
    assert store.version == 1
    np.testing.assert_array_equal(store.values()["mean"], np.array([3.0, 3.0], dtype=np.float32))


def test_snapshot_and_restore_round_trip_state_parts() -> None:
    store = make_store()
    store.push("w0", 0, {"mean": np.array([0.5, 0.5], dtype=np.float32), "w": np.ones(3, dtype=np.float32)})
    snap = store.snapshot()
    other = ShardStore()
    other.restore(snap)
    again = other.snapshot()
    assert again.rule.state == ("mean",) and again.slots["mean"] == {} and again.version == 1
    for name in snap.values:
        np.testing.assert_array_equal(again.values[name], snap.values[name])
    other.push("w0", 1, {"mean": np.array([1.0, 1.0], dtype=np.float32)})  # still a state part: added as is
    np.testing.assert_array_equal(other.values()["mean"], np.array([2.5, 3.5], dtype=np.float32))


def test_restore_refuses_optimizer_slots_on_a_state_part() -> None:
    store = make_store()
    snap = store.snapshot()
    bad = type(snap)(**{**snap.__dict__, "slots": {**snap.slots, "mean": dict(snap.slots["w"])}})
    with pytest.raises(InvalidArgumentError):
        ShardStore().restore(bad)
