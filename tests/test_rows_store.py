"""Row reads on the shard's store (no wire): rows served with their clocks, per-row staleness, tables the
shard makes itself, and hostile row requests refused with the state unchanged."""

from __future__ import annotations

import numpy as np
import pytest
from asyncps.ps.store import MAX_ROWS_PER_READ, ShardStore

from asyncps.errors import AlreadyExistsError, InvalidArgumentError, NotFoundError, ResourceExhaustedError
from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.rules.initializers import RowInit, TableSpec
from asyncps.wire.codec import SparseRows

UNIFORM = RowInit.parse("uniform:min=-1,max=1,seed=5")


def rule(optimizer: str = "sgd", policy: str = "none") -> UpdateRuleConfig:
    return UpdateRuleConfig(OptimizerConfig(optimizer, 0.5), staleness_policy=policy)


def table_store(optimizer: str = "sgd", policy: str = "none") -> ShardStore:
    store = ShardStore()
    assert store.initialize(rule(optimizer, policy), {"b": np.ones(3, np.float32)},
                            generated={"t": TableSpec((50, 4), "float32", 100, UNIFORM)})
    return store


def ids(*rows: int) -> np.ndarray:
    return np.array(rows, dtype=np.int64)


def test_a_generated_table_is_the_rows_of_the_whole_table_it_is_part_of() -> None:
    whole = TableSpec((150, 4), "float32", 0, UNIFORM).make()
    store = table_store()
    np.testing.assert_array_equal(store.values()["t"], whole[100:150])
    assert whole.min() >= -1 and whole.max() <= 1 and abs(float(whole.mean())) < 0.1


def test_a_row_read_serves_exactly_the_rows_asked_and_never_the_part_whole() -> None:
    store = table_store()
    reply = store.pull(rows={"t": ids(0, 7, 49)})
    assert reply.values is not None and set(reply.values) == {"b"}
    assert reply.rows is not None
    rows = reply.rows["t"]
    np.testing.assert_array_equal(rows.values, store.values()["t"][[0, 7, 49]])
    np.testing.assert_array_equal(rows.indices, [0, 7, 49])
    np.testing.assert_array_equal(rows.clocks, [0, 0, 0])


def test_rows_are_served_even_when_the_dense_values_are_not_newer() -> None:
    store = table_store()
    reply = store.pull(if_newer_than=0, rows={"t": ids(3)})
    assert reply.values is None and reply.rows is not None and reply.rows["t"].values.shape == (1, 4)


def test_clocks_count_each_rows_updates_and_a_push_measures_per_row_staleness() -> None:
    store = table_store()
    read = store.pull(rows={"t": ids(1, 2)}).rows
    assert read is not None
    grad = np.ones((1, 4), np.float32)
    # another worker updates row 1 twice
    for _ in range(2):
        store.push("other", store.version, {"t": SparseRows(ids(1), grad)})
    outcome = store.push("w", 0, {"t": SparseRows(ids(1, 2), np.ones((2, 4), np.float32), read["t"].clocks)})
    assert outcome.accepted and outcome.staleness == 2
    assert outcome.rows is not None
    assert (outcome.rows.rows, outcome.rows.max, outcome.rows.mean) == (2, 2, 1.0)
    again = store.pull(rows={"t": ids(1, 2, 3)}).rows
    assert again is not None
    np.testing.assert_array_equal(again["t"].clocks, [3, 1, 0])


def test_a_push_without_clocks_measures_no_row_staleness() -> None:
    store = table_store()
    outcome = store.push("w", 0, {"t": SparseRows(ids(1), np.ones((1, 4), np.float32))})
    assert outcome.accepted and outcome.rows is None


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adagrad", "adam"])
def test_reading_by_rows_changes_nothing_of_what_training_computes(optimizer: str) -> None:
    """The same pushes on a store read by rows and on one read whole end in the same state."""
    by_rows, whole = table_store(optimizer), table_store(optimizer)
    rng = np.random.default_rng(0)
    for _ in range(5):
        touched = np.unique(rng.integers(0, 50, 6)).astype(np.int64)
        read = by_rows.pull(rows={"t": touched}).rows
        assert read is not None
        np.testing.assert_array_equal(read["t"].values, whole.pull().values["t"][touched])  # type: ignore[index]
        grad = rng.normal(size=(touched.size, 4)).astype(np.float32)
        by_rows.push("w", by_rows.version, {"t": SparseRows(touched, grad, read["t"].clocks)})
        whole.push("w", whole.version, {"t": SparseRows(touched, grad)})
    np.testing.assert_array_equal(by_rows.values()["t"], whole.values()["t"])


def test_a_policy_that_corrects_with_the_values_read_gets_the_rows_read() -> None:
    store = table_store(policy="dc-asgd:lambda=0.5")
    read = store.pull(worker_id="w", rows={"t": ids(4)}).rows
    assert read is not None
    store.push("other", store.version, {"t": SparseRows(ids(4), np.ones((1, 4), np.float32))})
    outcome = store.push("w", 0, {"t": SparseRows(ids(4), np.ones((1, 4), np.float32), read["t"].clocks)})
    assert outcome.accepted and outcome.rows is not None and outcome.rows.max == 1


HOSTILE = [
    ("unknown", ids(1), NotFoundError, "unknown variable"),
    ("t", ids(-1, 2), InvalidArgumentError, "lie in"),
    ("t", ids(0, 50), InvalidArgumentError, "lie in"),
    ("t", ids(3, 3), InvalidArgumentError, "strictly increasing"),
    ("t", ids(5, 2), InvalidArgumentError, "strictly increasing"),
    ("t", np.array([1.0, 2.0]), InvalidArgumentError, "int64"),
    ("t", np.array([1, 2], dtype=np.int32), InvalidArgumentError, "int64"),
    ("t", ids(1).reshape(1, 1), InvalidArgumentError, "int64"),
    ("t", np.arange(MAX_ROWS_PER_READ + 1, dtype=np.int64), InvalidArgumentError, "at most"),
    ("b", np.zeros(0, np.int64), None, ""),
]


@pytest.mark.parametrize(("name", "asked", "error", "says"), HOSTILE)
def test_hostile_row_reads_are_refused_and_change_nothing(name: str, asked: np.ndarray, error: type[Exception] | None,
                                                          says: str) -> None:
    store = table_store()
    before, version = store.values(), store.version
    if error is None:
        assert store.pull(rows={name: asked}).rows is not None
    else:
        with pytest.raises(error, match=says):
            store.pull(rows={name: asked})
    after = store.values()
    assert store.version == version and all(np.array_equal(before[k], after[k]) for k in before)
    assert store.pull(rows={"t": ids(1)}).rows is not None  # still serves


@pytest.mark.parametrize(("clocks", "says"), [
    (np.array([0], np.int64), "one per index"), (np.array([0.0, 1.0]), "int64"),
    (np.array([-1, 0], np.int64), ">= 0")])
def test_hostile_clocks_in_a_push_are_refused(clocks: np.ndarray, says: str) -> None:
    store = table_store()
    before = store.values()
    with pytest.raises(InvalidArgumentError, match=says):
        store.push("w", 0, {"t": SparseRows(ids(1, 2), np.ones((2, 4), np.float32), clocks)})
    np.testing.assert_array_equal(store.values()["t"], before["t"])
    assert store.version == 0


def test_a_table_that_cannot_fit_is_refused_before_anything_is_made() -> None:
    store = ShardStore()
    huge = TableSpec((1 << 40, 1024), "float32", 0, UNIFORM)
    with pytest.raises(ResourceExhaustedError, match="does not fit"):
        store.initialize(rule(), {}, generated={"t": huge})
    assert store.rule is None


def test_a_reinitialization_with_another_table_spec_is_refused() -> None:
    store = table_store()
    assert not store.initialize(rule(), {"b": np.ones(3, np.float32)},
                                generated={"t": TableSpec((50, 4), "float32", 100, UNIFORM)})
    other = TableSpec((50, 4), "float32", 100, RowInit.parse("uniform:min=-1,max=1,seed=6"))
    with pytest.raises(AlreadyExistsError, match="already initialized as"):
        store.initialize(rule(), {"b": np.ones(3, np.float32)}, generated={"t": other})


def test_a_restored_table_is_read_by_rows_like_any_other() -> None:
    store = table_store("adagrad")
    store.push("w", 0, {"t": SparseRows(ids(2), np.ones((1, 4), np.float32))})
    snap = store.snapshot()
    fresh = ShardStore()
    fresh.restore(snap)
    reply = fresh.pull(rows={"t": ids(2)}).rows
    assert reply is not None
    np.testing.assert_array_equal(reply["t"].values, store.values()["t"][[2]])
    assert not fresh.initialize(rule("adagrad"), {"b": snap.values["b"]},
                                generated={"t": TableSpec((50, 4), "float32", 100, UNIFORM)})


@pytest.mark.parametrize("spec", ["gauss", "uniform:min=1,max=0", "normal:stddev=-1", "uniform:lo=1",
                                  "uniform:seed=1.5", "constant:value=nan"])
def test_a_bad_row_initializer_is_a_clear_error(spec: str) -> None:
    with pytest.raises(ValueError, match="row initializer"):
        RowInit.parse(spec)
