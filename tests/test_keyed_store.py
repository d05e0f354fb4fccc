"""Keyed tables on the shard's store (no wire): rows by int64 key of any value, made by the first push that
names them (never by a read), the least recently pushed evicted when the part is full, checkpointed with
their keys; and what a keyed part refuses, with the state unchanged."""

from __future__ import annotations

import numpy as np
import pytest
from asyncps.ps.keyed import KEYS, TOUCHED
from asyncps.ps.store import ShardStore

from asyncps.errors import InvalidArgumentError, ResourceExhaustedError
from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.rules.initializers import RowInit, TableSpec
from asyncps.wire.codec import SparseRows

UNIFORM = RowInit.parse("uniform:min=-1,max=1,seed=5")
BIG = np.iinfo(np.int64).max


def rule(optimizer: str = "sgd", mode: str = "async", policy: str = "none") -> UpdateRuleConfig:
    return UpdateRuleConfig(OptimizerConfig(optimizer, 0.5), mode=mode, staleness_policy=policy, num_workers=2)


def keyed_store(bound: int = 4, optimizer: str = "sgd") -> ShardStore:
    store = ShardStore()
    assert store.initialize(rule(optimizer), {"b": np.ones(3, np.float32)},
                            generated={"t": TableSpec((bound, 2), "float32", 0, UNIFORM, keyed=True)})
    return store


def keys(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def push(store: ShardStore, *ks: int, grad: float = 1.0, clocks: np.ndarray | None = None) -> None:
    rows = keys(*ks)
    outcome = store.push("w", store.version, {"t": SparseRows(rows, np.full((rows.size, 2), grad, np.float32),
                                                               clocks)})
    assert outcome.accepted


def read(store: ShardStore, *ks: int) -> SparseRows:
    reply = store.pull(rows={"t": keys(*ks)})
    assert reply.rows is not None
    return reply.rows["t"]


def held(store: ShardStore) -> set[int]:
    state = store.snapshot().policy_state["t"]
    return set(state[KEYS][state[TOUCHED] >= 0].tolist())


def test_a_key_never_pushed_reads_as_the_initializers_row_at_that_key_and_makes_nothing() -> None:
    store = keyed_store()
    got = read(store, -(1 << 62), -1, 0, 7, 1 << 40, BIG)
    expected = UNIFORM.rows_at(keys(-(1 << 62), -1, 0, 7, 1 << 40, BIG), (2,), np.float32)
    np.testing.assert_array_equal(got.values, expected)
    np.testing.assert_array_equal(got.clocks, [0] * 6)
    np.testing.assert_array_equal(UNIFORM.rows_at(keys(3, 4), (2,), np.float32), UNIFORM.rows(3, 5, (2,), np.float32))
    assert held(store) == set() and store.version == 0


def test_a_push_makes_its_rows_from_the_initializer_then_applies_the_gradient() -> None:
    store = keyed_store()
    before = read(store, 5, 1 << 50).values
    push(store, 1 << 50, 5, 5)  # a key named twice: its rows summed, as a positional table's
    after = read(store, 5, 1 << 50)
    np.testing.assert_allclose(after.values, before - 0.5 * np.array([[2.0, 2.0], [1.0, 1.0]]), rtol=1e-6)
    np.testing.assert_array_equal(after.clocks, [1, 1])
    assert held(store) == {5, 1 << 50}
    assert "t" not in (store.pull().values or {})  # a keyed part is never served whole


def test_a_full_part_evicts_the_least_recently_pushed_key_not_in_the_push() -> None:
    store = keyed_store(bound=4)
    push(store, 1, 2)
    push(store, 3, 4)
    push(store, 1)
    trained_1 = read(store, 1).values
    push(store, 5, 6)  # two places needed: keys 2 (oldest) and 3 give way
    assert held(store) == {1, 4, 5, 6}
    np.testing.assert_array_equal(read(store, 1).values, trained_1)
    np.testing.assert_array_equal(read(store, 2).values, UNIFORM.rows_at(keys(2), (2,), np.float32))
    push(store, 2, 4, 5, 6)  # a push may name the bound's worth of keys: 1 gives way, not a key it names
    assert held(store) == {2, 4, 5, 6}


def test_a_reused_place_starts_with_fresh_optimizer_slots() -> None:
    store = keyed_store(bound=1, optimizer="adagrad")
    push(store, 10, grad=3.0)
    push(store, 11, grad=1.0)  # evicts 10; 11's accumulator must not start from 10's
    fresh = keyed_store(bound=1, optimizer="adagrad")
    push(fresh, 11, grad=1.0)
    np.testing.assert_array_equal(read(store, 11).values, read(fresh, 11).values)
    np.testing.assert_array_equal(store.snapshot().slots["t"]["accumulator"],
                                  fresh.snapshot().slots["t"]["accumulator"])


def test_per_row_staleness_counts_the_updates_a_key_received_since_it_was_read() -> None:
    store = keyed_store()
    push(store, 1)
    seen = read(store, 1, 2)
    push(store, 1)
    push(store, 1)
    outcome = store.push("w2", store.version - 2, {"t": SparseRows(seen.indices, np.ones((2, 2), np.float32),
                                                                   seen.clocks)})
    assert outcome.accepted and outcome.rows is not None
    assert outcome.rows.max == 2 and outcome.rows.rows == 2 and outcome.rows.mean == 1.0  # key 2: made now, 0


def test_more_distinct_keys_in_one_push_than_the_bound_is_resource_exhausted_and_changes_nothing() -> None:
    store = keyed_store(bound=4)
    push(store, 1)
    before = store.snapshot()
    with pytest.raises(ResourceExhaustedError, match="5 distinct keys, more than the 4 rows"):
        push(store, 1, 2, 3, 4, 5)
    after = store.snapshot()
    assert after.version == before.version and held(store) == {1}
    np.testing.assert_array_equal(after.values["t"], before.values["t"])


@pytest.mark.parametrize(("grad", "message"), [
    (np.ones((4, 2), np.float32), "takes rows by key"),
    (SparseRows(np.array([1], np.int32), np.ones((1, 2), np.float32)), "keys must be int64"),
    (SparseRows(keys(1), np.ones((1, 3), np.float32)), "do not fit"),
])
def test_a_bad_push_to_a_keyed_part_is_invalid_and_changes_nothing(grad: object, message: str) -> None:
    store = keyed_store()
    with pytest.raises(InvalidArgumentError, match=message):
        store.push("w", 0, {"t": grad})  # type: ignore[dict-item]
    assert store.version == 0 and held(store) == set()


def test_row_reads_of_a_keyed_part_take_any_int64_but_keep_the_order_and_dtype_contract() -> None:
    store = keyed_store()
    with pytest.raises(InvalidArgumentError, match="strictly increasing"):
        store.pull(rows={"t": keys(3, 3)})
    with pytest.raises(InvalidArgumentError, match="int64"):
        store.pull(rows={"t": np.array([1], np.int32)})


@pytest.mark.parametrize(("mode", "policy", "message"), [
    ("sync", "none", "keyed tables train in the modes async, ssp"),
    ("async", "dc-asgd", "corrects with the values read"),
])
def test_a_keyed_part_is_refused_where_a_push_is_not_applied_as_it_arrives(mode: str, policy: str,
                                                                          message: str) -> None:
    store = ShardStore()
    with pytest.raises(InvalidArgumentError, match=message):
        store.initialize(rule(mode=mode, policy=policy), {},
                         generated={"t": TableSpec((4, 2), "float32", 0, UNIFORM, keyed=True)})
    assert store.rule is None


def test_a_snapshot_restores_the_keys_their_rows_and_the_eviction_order() -> None:
    store = keyed_store(bound=3, optimizer="adagrad")
    push(store, 7)
    push(store, -8)
    push(store, 9)
    snap = store.snapshot()
    assert snap.keyed["t"].keyed and snap.keyed["t"].shape == (3, 2)
    other = ShardStore()
    other.restore(snap)
    np.testing.assert_array_equal(read(other, -8, 7, 9).values, read(store, -8, 7, 9).values)
    push(other, 10)  # 7 is the oldest: it gives way on both
    push(store, 10)
    assert held(other) == held(store) == {-8, 9, 10}
    np.testing.assert_array_equal(read(other, -8, 9, 10).values, read(store, -8, 9, 10).values)


def test_a_restore_with_broken_keys_is_refused_and_changes_nothing() -> None:
    store = keyed_store(bound=3)
    push(store, 1, 2)
    snap = store.snapshot()
    state = dict(snap.policy_state["t"])
    state[KEYS] = np.array([5, 5, 0], np.int64)  # two rows claim key 5
    import dataclasses
    broken = dataclasses.replace(snap, policy_state={"t": state})
    with pytest.raises(InvalidArgumentError, match="a key held by two rows"):
        store.restore(broken)
    no_spec = dataclasses.replace(snap, keyed={})
    with pytest.raises(InvalidArgumentError, match="keys for a part that is not keyed"):
        store.restore(no_spec)
    assert held(store) == {1, 2} and store.version == 1
