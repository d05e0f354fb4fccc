"""Staleness corrections through the store and a shard process: DC-ASGD, DC-ASGD-a and gap-aware
applied to real stale pushes (against their formulas written out here), per-row state for sparse
gradients, and the policy state carried by snapshots, checkpoints and restores."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from asyncps.chief.checkpoint import CheckpointDir, assemble, assemble_policy_state, split
from asyncps.ps.policy_state import ReadValues
from asyncps.ps.store import ShardStore

from asyncps.errors import InvalidArgumentError
from asyncps.placement import VariableSpec, place
from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.transport import connect_shard
from asyncps.wire.codec import SparseRows
from asyncps.wire.shard import PushRequest, Snapshot

LR = 0.5
M = np.float32(0.95)  # DC-ASGD-a's default momentum
EPS = np.float32(1e-7)


def f32(*x: float) -> np.ndarray:
    return np.array(x, dtype=np.float32)


def rule(policy: str) -> UpdateRuleConfig:
    return UpdateRuleConfig(OptimizerConfig("sgd", LR), staleness_policy=policy)


def store_with(policy: str, values: dict[str, np.ndarray]) -> ShardStore:
    store = ShardStore()
    store.initialize(rule(policy), values)
    return store


def stale_push(store: ShardStore, g_fresh: np.ndarray, g_stale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Worker A reads w0; worker B reads w0 and pushes g_fresh (w1); A pushes g_stale from w0.
    Returns (w0, w1)."""
    w0 = store.pull(-1, "A").values["w"].copy()  # type: ignore[index]
    store.pull(-1, "B")
    assert store.push("B", 0, {"w": g_fresh}).staleness == 0
    w1 = store.values()["w"]
    outcome = store.push("A", 0, {"w": g_stale})
    assert outcome.accepted and outcome.staleness == 1
    return w0, w1


def test_dc_asgd_corrects_a_stale_push_in_the_store() -> None:
    lam = np.float32(0.5)
    store = store_with("dc-asgd:lambda=0.5", {"w": f32(1, 2, 3)})
    g_b, g_a = f32(1, -2, 0.5), f32(2, 1, -1)
    w0, w1 = stale_push(store, g_b, g_a)
    np.testing.assert_array_equal(w1, w0 - np.float32(LR) * g_b)  # a fresh gradient is left as it is
    expected = w1 - np.float32(LR) * (g_a + lam * g_a * g_a * (w1 - w0))
    np.testing.assert_allclose(store.values()["w"], expected, rtol=1e-6)
    assert not np.allclose(expected, w1 - np.float32(LR) * g_a)  # the correction is not nothing


def test_dc_asgd_adaptive_corrects_with_the_running_mean_square_in_the_store() -> None:
    lam0 = np.float32(2.0)
    store = store_with("dc-asgd-a", {"w": f32(1, 2, 3)})
    g_b, g_a = f32(1, -2, 0.5), f32(2, 1, -1)
    w0, w1 = stale_push(store, g_b, g_a)
    mean_square = M * ((1 - M) * g_b * g_b) + (1 - M) * g_a * g_a  # B's push, then A's
    corrected = g_a + lam0 / np.sqrt(mean_square + EPS) * g_a * g_a * (w1 - w0)
    np.testing.assert_allclose(store.values()["w"], w1 - np.float32(LR) * corrected, rtol=1e-6)
    np.testing.assert_allclose(store.snapshot().policy_state["w"]["mean_square"], mean_square, rtol=1e-6)


def test_gap_aware_divides_a_stale_push_by_its_gap_in_the_store() -> None:
    c = np.float32(0.25)
    store = store_with("gap-aware:c=0.25", {"w": f32(1, 2, 3)})
    g_b, g_a = f32(1, -2, 0.5), f32(2, 1, -1)
    w0, w1 = stale_push(store, g_b, g_a)
    expected = w1 - np.float32(LR) * (g_a / (1 + np.abs(w1 - w0) / c))
    np.testing.assert_allclose(store.values()["w"], expected, rtol=1e-6)


def sparse(rows: list[int], values: np.ndarray) -> SparseRows:
    return SparseRows(np.array(rows, np.int64), values)


def test_dc_asgd_adaptive_keeps_its_mean_square_per_row_for_sparse_pushes() -> None:
    lam0 = np.float32(2.0)
    store = store_with("dc-asgd-a", {"w": np.zeros((4, 2), np.float32)})
    store.pull(-1, "A")
    w0 = store.values()["w"]
    store.pull(-1, "B")
    g1 = np.array([[1, 2], [3, 4]], np.float32)
    g2 = np.array([[10, 20], [30, 40]], np.float32)
    g3 = np.array([[-1, 1], [2, -2]], np.float32)
    store.push("B", 0, {"w": sparse([0, 1], g1)})
    store.push("B", 1, {"w": sparse([2, 3], g2)})
    w2 = store.values()["w"]
    store.push("A", 0, {"w": sparse([1, 0], g3[::-1])})  # rows out of order: each meets its own state

    ms = np.zeros((4, 2), np.float32)
    ms[[0, 1]] = (1 - M) * g1 * g1
    # B's second push corrects rows 2 and 3 with their own (empty) history, not rows 0 and 1's
    ms[[2, 3]] = (1 - M) * g2 * g2
    ms_rows01 = M * ms[[0, 1]] + (1 - M) * g3 * g3
    corrected = g3 + lam0 / np.sqrt(ms_rows01 + EPS) * g3 * g3 * (w2[[0, 1]] - w0[[0, 1]])
    final = store.values()["w"]
    np.testing.assert_allclose(final[[0, 1]], w2[[0, 1]] - np.float32(LR) * corrected, rtol=1e-6)
    np.testing.assert_array_equal(final[[2, 3]], w2[[2, 3]])
    state = store.snapshot().policy_state["w"]
    np.testing.assert_allclose(state["mean_square"], np.concatenate([ms_rows01, ms[[2, 3]]]), rtol=1e-6)
    assert state["mean_square@rows"].tolist() == [1, 1, 1, 1]


def test_gap_aware_treats_a_row_it_never_saw_as_having_no_step_estimate() -> None:
    store = store_with("gap-aware", {"w": np.zeros((3, 2), np.float32)})
    store.pull(-1, "A")
    store.pull(-1, "B")
    for step in range(3):  # row 0 moves: it gets a previous value and a step estimate
        store.push("B", step, {"w": sparse([0], np.ones((1, 2), np.float32))})
    before = store.values()["w"]
    g = np.array([[5, 5]], np.float32)
    store.push("A", 0, {"w": sparse([1], g)})  # stale by 3, but row 1 has no history: applied as it is
    np.testing.assert_array_equal(store.values()["w"][1], before[1] - np.float32(LR) * g[0])
    state = store.snapshot().policy_state["w"]
    assert state["step_size@rows"].tolist() == [1, 0, 0]
    assert state["previous_value@rows"].tolist() == [1, 1, 0]


def test_duplicate_sparse_rows_advance_a_rows_state_once() -> None:
    store = store_with("dc-asgd-a", {"w": np.zeros((2, 2), np.float32)})
    store.pull(-1, "B")
    store.push("B", 0, {"w": sparse([1, 1], np.ones((2, 2), np.float32))})
    np.testing.assert_allclose(store.snapshot().policy_state["w"]["mean_square"][1], (1 - M) * f32(4, 4),
                               rtol=1e-6)


def store_pusher(store: ShardStore) -> Callable[[str, int, dict[str, object]], None]:
    def push(worker: str, base: int, grads: dict[str, object]) -> None:
        store.pull(-1, worker)
        store.push(worker, base, grads)  # type: ignore[arg-type]
    return push


def push_sequence(push: Callable[[str, int, dict[str, object]], None], start: int) -> None:
    """A fixed mix of dense and sparse, fresh and stale pushes from versions >= start."""
    rng = np.random.default_rng(start)
    for i in range(6):
        rows = sorted(rng.choice(8, size=3, replace=False).tolist())
        grads: dict[str, object] = {"emb": sparse(rows, rng.standard_normal((3, 4)).astype(np.float32)),
                                    "b": rng.standard_normal(4).astype(np.float32)}
        push("A" if i % 2 else "B", start + i - (i % 3), grads)


def test_policy_state_survives_snapshot_and_restore_through_shard_processes(
    start_shards: Callable[[int], list[str]]
) -> None:
    first, second = (connect_shard(a, deadline_s=60.0) for a in start_shards(2))
    try:
        values = {"emb": np.zeros((8, 4), np.float32), "b": np.zeros(4, np.float32)}
        policy = "dc-asgd-a"
        first.initialize("chief", 0, 1, rule(policy), values)

        def pusher(shard: object) -> Callable[[str, int, dict[str, object]], None]:
            steps = itertools.count(1)  # each push its own step, as a worker numbers them (a repeat is a retry)

            def push(worker: str, base: int, grads: dict[str, object]) -> None:
                shard.pull(worker)  # type: ignore[attr-defined]  # the values the correction reads
                shard.push(PushRequest(worker, base, grads, next(steps), 0.0))  # type: ignore[attr-defined, arg-type]
            return push

        push_sequence(pusher(first), 0)
        snap = first.snapshot()
        assert set(snap.policy_state) == {"emb", "b"} and "mean_square" in snap.policy_state["emb"]
        second.restore(snap, 0)
        restored = second.snapshot()
        for name, state in snap.policy_state.items():
            for key, array in state.items():
                np.testing.assert_array_equal(restored.policy_state[name][key], array)
        # both continue the same way: the restored state gives the same corrections
        push_sequence(pusher(first), snap.version)
        push_sequence(pusher(second), snap.version)
        a, b = first.snapshot(), second.snapshot()
        for name in values:
            np.testing.assert_array_equal(a.values[name], b.values[name])
    finally:
        first.close()
        second.close()


def test_policy_state_goes_through_a_checkpoint_into_another_shard_count(tmp_path: Path) -> None:
    specs = [VariableSpec("emb", (8, 4), "float32"), VariableSpec("b", (4,), "float32")]
    two = place(specs, 2, slice_threshold_bytes=64)
    assert any(p.sliced for p in two.parts)
    values = {"emb": np.zeros((8, 4), np.float32), "b": np.zeros(4, np.float32)}
    one = store_with("gap-aware", values)
    push_sequence(store_pusher(one), 0)
    whole = one.snapshot()
    # cut the one store's state into the two-shard placement, as a 2-shard run would hold it
    stores = []
    for shard in range(2):
        store = ShardStore(shard)
        part_values = {p.name: whole.values[p.variable][p.rows()] if p.sliced else whole.values[p.variable]
                       for p in two.parts_on(shard)}
        store.initialize(rule("gap-aware"), part_values)
        stores.append(store)
    snaps = []
    for shard, store in enumerate(stores):
        state = {p.name: {k: (a[p.rows()] if p.sliced else a) for k, a in whole.policy_state[p.variable].items()}
                 for p in two.parts_on(shard)}
        base = store.snapshot()
        snaps.append(Snapshot(base.rule, whole.version, 0, 0, base.values, base.slots, base.updates,
                              policy_state=state))
        store.restore(snaps[-1])
    values_back, slots_back = assemble(two, [s.snapshot() for s in stores])
    state_back = assemble_policy_state(two, [s.snapshot() for s in stores])
    path = CheckpointDir(tmp_path).save(1, values_back, slots_back, {
        "shard_versions": [whole.version] * 2, "shard_counters": [{"accepted": 0, "dropped": 0}] * 2,
        "updates": {}, "variable_updates": {}}, state_back)
    ckpt = CheckpointDir.load(path)
    for name, state in whole.policy_state.items():
        for key, array in state.items():
            np.testing.assert_array_equal(ckpt.policy_state[name][key], array)
    # and back into one shard
    (single,) = split(place(specs, 1), ckpt, rule("gap-aware"))
    restored = ShardStore()
    restored.restore(single)
    for name, state in whole.policy_state.items():
        for key, array in state.items():
            np.testing.assert_array_equal(restored.snapshot().policy_state[name][key], array)


@pytest.mark.parametrize("state, message", [
    ({"mean_square": np.zeros(4, np.float32)}, "KEY@rows"),
    ({"mean_square": np.zeros(3, np.float32), "mean_square@rows": np.ones(1, np.int32)}, "finite floats"),
    ({"mean_square": np.full(4, np.nan, np.float32), "mean_square@rows": np.ones(4, np.int32)}, "finite floats"),
    ({"mean_square": np.zeros(4, np.float32), "mean_square@rows": np.full(4, 2, np.int32)}, "0/1"),
])
def test_a_bad_restored_policy_state_is_invalid_and_changes_nothing(state: dict[str, np.ndarray],
                                                                    message: str) -> None:
    store = store_with("dc-asgd-a", {"b": np.zeros(4, np.float32)})
    snap = store.snapshot()
    bad = Snapshot(snap.rule, 5, 0, 0, snap.values, snap.slots, snap.updates, policy_state={"b": state})
    with pytest.raises(InvalidArgumentError, match=message):
        store.restore(bad)
    assert store.version == 0
    with pytest.raises(InvalidArgumentError, match="unknown variables"):
        store.restore(Snapshot(snap.rule, 5, 0, 0, snap.values, snap.slots, snap.updates, policy_state={"x": {}}))


def test_a_push_is_corrected_against_the_values_of_its_base_version_not_the_last_read() -> None:
    """A pipelined worker read w0, then w1 (the reply of its previous push), and pushes a gradient
    computed from w0: DC-ASGD's gap is w_now - w0. Only the last two reads are kept."""
    lam = np.float32(0.5)
    store = store_with("dc-asgd:lambda=0.5", {"w": f32(1, 2, 3)})
    g1, g2 = f32(1, -2, 0.5), f32(2, 1, -1)
    w0 = store.pull(-1, "A").values["w"].copy()  # type: ignore[index]
    store.push("A", 0, {"w": g1})
    w1 = store.pull(-1, "A").values["w"].copy()  # type: ignore[index]
    assert store.push("A", 0, {"w": g2}).staleness == 1  # computed from w0
    np.testing.assert_allclose(store.values()["w"], w1 - np.float32(LR) * (g2 + lam * g2 * g2 * (w1 - w0)),
                               rtol=1e-6)
    for _ in range(3):  # more reads: the read of version 0 is forgotten, memory stays bounded
        store.push("A", store.version, {"w": g1})
        store.pull(-1, "A")
    assert len(store._reads._by_worker["A"]) == ReadValues.KEEP
