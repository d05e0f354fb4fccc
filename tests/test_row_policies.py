"""Per-row staleness policies on the shard's store (no wire): `row-drop` drops exactly the rows staler than
its bound and leaves their state untouched, `row-lr-scale` scales each row's learning rate by its own
staleness, dense parts and pushes without clocks are judged by the push's staleness, hostile parameters
are refused; and the hot rows of a push are counted apart."""

from __future__ import annotations

import numpy as np
import pytest
from asyncps.ps.store import ShardStore

from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.rules.initializers import RowInit, TableSpec
from asyncps.rules.optimizers import make_optimizer
from asyncps.rules.policies import parse_policy
from asyncps.wire.codec import SparseRows
from asyncps.wire.shard import DropReason

LR = 0.5
UNIFORM = RowInit.parse("uniform:min=-1,max=1,seed=5")


def table_store(policy: str, optimizer: str = "sgd") -> ShardStore:
    """A store with a dense part `b` [3] and a generated table `t` [50, 4]."""
    store = ShardStore()
    rule = UpdateRuleConfig(OptimizerConfig(optimizer, LR), staleness_policy=policy)
    assert store.initialize(rule, {"b": np.ones(3, np.float32)},
                            generated={"t": TableSpec((50, 4), "float32", 0, UNIFORM)})
    return store


def ids(*rows: int) -> np.ndarray:
    return np.array(rows, dtype=np.int64)


def ones(rows: int) -> np.ndarray:
    return np.ones((rows, 4), np.float32)


def stale_read(store: ShardStore, updates: dict[int, int]) -> SparseRows:
    """Read rows 0..4 (clocks 0), then let another worker update row r `updates[r]` times (one row a push)."""
    read = store.pull(rows={"t": ids(0, 1, 2, 3, 4)}).rows
    assert read is not None
    for row, times in updates.items():
        for _ in range(times):
            store.push("other", store.version, {"t": SparseRows(ids(row), ones(1))})
    return read["t"]


def test_row_drop_applies_the_fresh_rows_and_leaves_the_stale_ones_untouched() -> None:
    store = table_store("row-drop:bound=1")
    read = stale_read(store, {0: 2, 1: 1, 2: 3})  # row staleness 2, 1, 3, 0, 0
    before = store.values()["t"]
    clocks_before = store.pull(rows={"t": ids(0, 1, 2, 3, 4)}).rows
    outcome = store.push("w", 0, {"t": SparseRows(ids(0, 1, 2, 3, 4), ones(5), read.clocks)})
    after = store.values()["t"]
    assert outcome.accepted and outcome.staleness == 6 and outcome.rows is not None
    assert (outcome.rows.rows, outcome.rows.dropped, outcome.rows.max) == (5, 2, 3)
    np.testing.assert_array_equal(after[[0, 2]], before[[0, 2]])  # dropped: values unchanged
    np.testing.assert_allclose(after[[1, 3, 4]], before[[1, 3, 4]] - LR)  # kept: plain SGD at lr
    np.testing.assert_array_equal(after[5:], before[5:])
    clocks = store.pull(rows={"t": ids(0, 1, 2, 3, 4)}).rows
    assert clocks is not None and clocks_before is not None
    np.testing.assert_array_equal(clocks["t"].clocks - clocks_before["t"].clocks, [0, 1, 0, 1, 1])


def test_row_drop_leaves_a_dropped_rows_optimizer_state_untouched() -> None:
    store = table_store("row-drop:bound=0", optimizer="adam")
    read = stale_read(store, {0: 1})
    slots_before = {k: a.copy() for k, a in store.snapshot().slots["t"].items()}
    store.push("w", 0, {"t": SparseRows(ids(0, 3), ones(2), read.clocks[[0, 3]])})
    slots = store.snapshot().slots["t"]
    for name, array in slots.items():
        np.testing.assert_array_equal(array[0], slots_before[name][0])  # row 0 dropped: moments as they were
        assert not np.array_equal(array[3], slots_before[name][3])  # row 3 applied: moments moved


def test_row_drop_judges_a_dense_part_by_the_pushs_staleness() -> None:
    store = table_store("row-drop:bound=1")
    read = stale_read(store, {0: 2})  # the push's staleness is 2, row 3's is 0
    rows = SparseRows(ids(0, 3), ones(2), read.clocks[[0, 3]])
    outcome = store.push("w", 0, {"b": np.ones(3, np.float32), "t": rows})
    assert outcome.accepted and outcome.rows is not None and outcome.rows.dropped == 1
    np.testing.assert_array_equal(store.values()["b"], np.ones(3, np.float32))  # dense part dropped whole
    fresh = store.push("w", store.version, {"b": np.ones(3, np.float32)})
    assert fresh.accepted and fresh.rows is None
    np.testing.assert_allclose(store.values()["b"], 1 - LR)


def test_row_drop_drops_a_push_it_keeps_nothing_of_and_a_push_without_clocks_as_drop_does() -> None:
    store = table_store("row-drop:bound=1")
    read = stale_read(store, {0: 2})
    version, before = store.version, store.values()
    stale = store.push("w", 0, {"t": SparseRows(ids(0), ones(1), read.clocks[:1])})
    assert not stale.accepted and stale.drop is DropReason.STALE and "row-drop:bound=1" in stale.detail
    assert stale.rows is not None and (stale.rows.rows, stale.rows.dropped) == (1, 1)
    unclocked = store.push("w", 0, {"t": SparseRows(ids(3), ones(1))})  # staleness 2 > 1, no clocks
    assert not unclocked.accepted and unclocked.drop is DropReason.STALE and unclocked.rows is None
    assert store.version == version and store.stats().pushes_dropped == 2
    for name, value in store.values().items():
        np.testing.assert_array_equal(value, before[name])


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_row_lr_scale_scales_each_rows_learning_rate_by_its_own_staleness(optimizer: str) -> None:
    store = table_store("row-lr-scale", optimizer)
    read = stale_read(store, {0: 4, 1: 2})  # row staleness 4, 2, 0 (rows 0, 1, 3)
    before = store.snapshot()
    outcome = store.push("w", 0, {"t": SparseRows(ids(3, 1, 0), ones(3), read.clocks[[3, 1, 0]])})
    assert outcome.accepted and outcome.rows is not None and outcome.rows.dropped == 0
    assert outcome.effective_lr == pytest.approx(LR / 6)  # a dense part's rate: the push's staleness is 6
    # the oracle: each row alone, by the optimizer, at lr / max(1, its staleness)
    opt = make_optimizer(OptimizerConfig(optimizer, LR))
    for row, scale in ((0, 1 / 4), (1, 1 / 2), (3, 1.0)):
        value = before.values["t"][row:row + 1].copy()
        slots = {k: a[row:row + 1].copy() for k, a in before.slots["t"].items()}
        opt.apply_sparse(value, ids(0), ones(1), slots, LR * scale, before.updates["t"] + 1)
        np.testing.assert_allclose(store.values()["t"][row], value[0], rtol=1e-6)


def test_a_row_named_twice_is_applied_once_as_stale_as_its_stalest_entry() -> None:
    store = table_store("row-lr-scale")
    read = stale_read(store, {0: 4})
    before = store.values()["t"][0].copy()
    clocks = np.array([read.clocks[0], read.clocks[0] + 4], dtype=np.int64)  # staleness 4 and 0
    assert store.push("w", 0, {"t": SparseRows(ids(0, 0), ones(2), clocks)}).accepted
    np.testing.assert_allclose(store.values()["t"][0], before - 2 * LR / 4)


@pytest.mark.parametrize("spec", ["row-drop", "row-drop:bound=-1", "row-drop:bound=1.5", "row-drop:bound=true",
                                  "row-drop:bound=x", "row-drop:bound=1,k=2", "row-lr-scale:bound=1"])
def test_hostile_parameters_are_refused_with_a_clear_error(spec: str) -> None:
    with pytest.raises(ValueError, match=r"row-(drop|lr-scale)"):
        parse_policy(spec)


def test_the_per_row_policies_spell_their_specs_back() -> None:
    for spec in ("row-drop:bound=3", "row-lr-scale"):
        assert parse_policy(spec).spec == spec and parse_policy(spec).per_row
    assert not parse_policy("drop:bound=3").per_row


def test_hot_rows_are_the_ones_in_at_least_one_update_in_a_hundred() -> None:
    store = table_store("none")
    read = store.pull(rows={"t": ids(0, 1)}).rows
    assert read is not None
    for push in range(200):  # row 0 in every push, row 1 in one only: 1 of 200 < 1 of 100
        rows = ids(0, 1) if push == 0 else ids(0)
        store.push("other", store.version, {"t": SparseRows(rows, ones(rows.size))})
    outcome = store.push("w", 0, {"t": SparseRows(ids(0, 1), ones(2), read["t"].clocks)})
    assert outcome.rows is not None
    assert (outcome.rows.hot_rows, outcome.rows.hot_mean, outcome.rows.cold_mean) == (1, 200.0, 1.0)


def test_a_shards_rule_with_a_hostile_per_row_policy_is_refused_before_any_state_exists() -> None:
    with pytest.raises(ValueError, match=r"bound must be an integer >= 0"):
        UpdateRuleConfig(OptimizerConfig("sgd", LR), staleness_policy="row-drop:bound=-1")


@pytest.mark.parametrize(("indices", "scale", "error"), [
    ((0, 1), (1.0,), "one scale per index"),
    ((1, 0), (1.0, 1.0), "strictly increasing"),
    ((0, 0), (1.0, 1.0), "strictly increasing"),
    ((0, 1), (1.0, -0.5), "finite and >= 0"),
    ((0, 1), (1.0, float("nan")), "finite and >= 0"),
])
def test_per_row_rates_that_do_not_fit_are_refused_and_change_nothing(indices: tuple[int, ...],
                                                                       scale: tuple[float, ...], error: str) -> None:
    opt = make_optimizer(OptimizerConfig("sgd", LR))
    value = np.zeros((4, 2), np.float32)
    with pytest.raises(ValueError, match=error):
        opt.apply_sparse(value, ids(*indices), np.ones((len(indices), 2), np.float32), {}, LR, 1,
                         np.array(scale))
    assert not value.any()
