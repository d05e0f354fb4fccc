"""Consistency models on the shard store directly: sync (with backup workers) and SSP."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from asyncps.ps.store import ShardStore

from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.rules.modes import SSPConsistency, make_consistency
from asyncps.rules.sync.bsp import SyncConsistency
from asyncps.wire.shard import DropReason


def make_store(mode: str, workers: int, backup: int = 0, bound: int = 0) -> ShardStore:
    store = ShardStore()
    spec = {"sync": f"sync:backup={backup}", "ssp": f"ssp:bound={bound}"}.get(mode, mode)
    rule = UpdateRuleConfig(OptimizerConfig("sgd", 1.0), mode=spec, num_workers=workers)
    store.initialize(rule, {"w": np.zeros(3, np.float32)})
    return store


def grad(v: float) -> dict[str, np.ndarray]:
    return {"w": np.full(3, v, np.float32)}


def test_sync_applies_the_average_once_per_version_with_staleness_zero() -> None:
    store = make_store("sync", workers=3)
    outcomes = [store.push(f"w{i}", 0, grad(float(i + 1))) for i in range(3)]
    assert [o.staleness for o in outcomes] == [0, 0, 0]
    assert all(o.accepted for o in outcomes)
    assert store.version == 1
    np.testing.assert_array_equal(store.values()["w"], np.full(3, -2.0, np.float32))  # -(1+2+3)/3


def test_sync_waits_for_the_quorum_and_drops_late_and_duplicate_gradients() -> None:
    store = make_store("sync", workers=3, backup=1)
    store.push("w0", 0, grad(1.0))
    dup = store.push("w0", 0, grad(5.0))
    assert not dup.accepted and dup.drop is DropReason.DUPLICATE and dup.detail.startswith("duplicate")
    assert store.version == 0
    store.push("w1", 0, grad(3.0))  # quorum of 3 - 1 = 2 reached
    assert store.version == 1
    np.testing.assert_array_equal(store.values()["w"], np.full(3, -2.0, np.float32))
    late = store.push("w2", 0, grad(100.0))
    assert not late.accepted and late.drop is DropReason.LATE and late.staleness == 1
    assert store.version == 1
    assert store.stats().dropped_by_reason == {"duplicate": 1, "late": 1}


def test_sync_quorum_shrinks_when_a_worker_dies_and_grows_when_one_joins() -> None:
    store = make_store("sync", workers=3)
    store.push("w0", 0, grad(1.0))
    store.push("w1", 0, grad(1.0))
    assert store.version == 0  # waiting for w2
    store.set_live_workers(["w0", "w1"])  # the chief declared w2 dead: the pending step completes
    assert store.version == 1
    store.set_live_workers(["w0", "w1", "w3"])
    store.push("w0", 1, grad(1.0))
    store.push("w1", 1, grad(1.0))
    assert store.version == 1
    store.push("w3", 1, grad(1.0))
    assert store.version == 2


def test_sync_readers_block_until_their_step_completes() -> None:
    store = make_store("sync", workers=2)
    store.push("w0", 0, grad(1.0))
    gate = store.wait_readable("w0", 0, timeout_s=0.05)
    assert not gate.readable and gate.waited_s >= 0.04  # times out: w1 has not pushed
    released = threading.Event()

    def reader() -> None:
        if store.wait_readable("w0", 0, timeout_s=30).readable:
            released.set()

    t = threading.Thread(target=reader)
    t.start()
    store.push("w1", 0, grad(1.0))
    t.join(timeout=10)
    assert released.is_set() and store.version == 1


@pytest.mark.parametrize("bound", [0, 1, 3])
def test_ssp_clock_lead_never_exceeds_the_bound(bound: int) -> None:
    workers = 3
    store = make_store("ssp", workers=workers, bound=bound)
    store.set_live_workers([f"w{i}" for i in range(workers)])
    steps = 12
    leads: list[int] = []
    lock = threading.Lock()
    mode = store._mode  # the invariant is checked on the model's own clocks
    assert isinstance(mode, SSPConsistency)
    barrier = threading.Barrier(workers)

    def run(i: int) -> None:
        rng = np.random.default_rng(i)
        barrier.wait()
        for _ in range(steps):
            base = store.version
            store.push(f"w{i}", base, grad(float(rng.integers(1, 4))))
            store.wait_readable(f"w{i}", base, timeout_s=30)
            with lock:
                leads.append(mode.lead(f"w{i}"))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert store.version == workers * steps  # every push applied, nobody deadlocked
    assert max(leads) <= bound
    assert store.stats().mode_stats["max_clock_lead"] <= bound


def test_ssp_holds_a_worker_that_runs_ahead() -> None:
    store = make_store("ssp", workers=2, bound=1)
    store.set_live_workers(["fast", "slow"])
    store.push("fast", 0, grad(1.0))
    assert store.wait_readable("fast", 0, 0.0).readable  # lead 1 <= 1
    store.push("fast", 1, grad(1.0))
    mode = store._mode
    assert isinstance(mode, SSPConsistency)
    assert mode.lead("fast") == 2 and not mode.readable("fast", 1, store.version)
    store.push("slow", 0, grad(1.0))
    assert mode.readable("fast", 1, store.version)
    store.set_live_workers(["fast"])  # slow died: fast is no longer held back by it
    store.push("fast", 3, grad(1.0))
    store.push("fast", 4, grad(1.0))
    assert mode.readable("fast", 4, store.version)


def test_make_consistency_names() -> None:
    sync = make_consistency("sync:backup=1", 2)
    assert isinstance(sync, SyncConsistency) and sync.quorum() == 1
    with pytest.raises(ValueError, match="unknown consistency mode 'bsp'"):
        make_consistency("bsp", 2)
