"""Dutta et al.'s K-variants (k-async, k-batch-sync, k-batch-async) on the shard state directly:
the count and the average of each step, who may read when, and over two shards (a coordinator
store and a follower store) the follower applying exactly the pushes shard 0 decided."""

from __future__ import annotations

import numpy as np
import pytest
from asyncps.ps.store import ShardStore

from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.rules.modes import MODES
from asyncps.rules.sync import Ballot
from asyncps.rules.sync.follower import SyncFollower
from asyncps.wire.shard import DropReason

WORKERS = ["w0", "w1", "w2"]


def shard(mode: str, index: int = 0, name: str = "a", workers: int = 3) -> ShardStore:
    store = ShardStore(shard_index=index)
    store.initialize(UpdateRuleConfig(OptimizerConfig("sgd", 1.0), mode=mode, num_workers=workers),
                     {name: np.zeros(2, np.float32)})
    store.set_live_workers(WORKERS[:workers])
    return store


def g(v: float) -> np.ndarray:
    return np.full(2, v, np.float32)


def value(store: ShardStore, name: str = "a") -> float:
    values = store.values()[name]
    assert values[0] == values[1]
    return -float(values[0])  # sgd with lr 1 from 0: minus the sum of the applied averages


@pytest.mark.parametrize("spec", ["k-async:k=2", "k-batch-sync:k=3", "k-batch-async:k=5"])
def test_the_k_modes_are_registered_coordinated_and_round_trip(spec: str) -> None:
    mode = MODES.parse(spec)
    assert mode.coordinated and mode.spec == spec
    assert isinstance(mode.start(3, shard_index=1), SyncFollower)
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        MODES.parse(spec.split(":")[0] + ":k=0")


def test_k_async_applies_the_mean_of_exactly_the_first_two_of_three_workers() -> None:
    store = shard("k-async:k=2")
    store.push("w0", 0, {"a": g(1.0)}, step=0)
    assert store.version == 0 and value(store) == 0.0  # one of two: nothing applied yet
    assert store.push("w1", 0, {"a": g(10.0)}, step=0).accepted
    assert store.version == 1 and value(store) == pytest.approx(5.5)  # mean of 1 and 10, not 3's
    # w2 computed from version 0: its stale gradient is the first of the next step, not dropped
    stale = store.push("w2", 0, {"a": g(100.0)}, step=0)
    assert stale.accepted and stale.staleness == 1 and store.version == 1
    store.push("w0", 1, {"a": g(20.0)}, step=1)
    assert store.version == 2 and value(store) == pytest.approx(5.5 + 60.0)
    stats = store.stats().mode_stats
    assert stats["k_steps"] == 2 and stats["k_max_staleness"] == 1 and stats["k_max_pushes_per_worker"] == 1


def test_k_async_takes_distinct_workers_and_a_worker_waits_for_its_step() -> None:
    store = shard("k-async:k=2")
    store.push("w0", 0, {"a": g(1.0)}, step=0)
    assert not store.wait_readable("w0", 0, 0.0).readable  # its gradient is not applied yet
    assert store.wait_readable("w1", 0, 0.0).readable  # w1 has nothing pending: computes on
    again = store.push("w0", 0, {"a": g(1000.0)}, step=1)
    assert not again.accepted and again.drop is DropReason.DUPLICATE
    store.push("w1", 0, {"a": g(3.0)}, step=0)
    assert store.version == 1 and value(store) == pytest.approx(2.0)
    assert store.wait_readable("w0", 0, 0.0).readable


def test_k_async_needs_no_more_workers_than_are_alive() -> None:
    store = shard("k-async:k=3")
    store.set_live_workers(["w0", "w1"])
    store.push("w0", 0, {"a": g(2.0)}, step=0)
    store.push("w1", 0, {"a": g(4.0)}, step=0)
    assert store.version == 1 and value(store) == pytest.approx(3.0)


def test_k_batch_sync_counts_mini_batches_so_one_worker_may_push_twice() -> None:
    store = shard("k-batch-sync:k=2")
    store.push("w0", 0, {"a": g(1.0)}, step=0)
    assert store.wait_readable("w0", 0, 0.0).readable  # no wait: next mini-batch at the same values
    store.push("w0", 0, {"a": g(5.0)}, step=1)
    assert store.version == 1 and value(store) == pytest.approx(3.0)  # mean of w0's two mini-batches
    # w1 was still computing at version 0: interrupted, its gradient is dropped as late
    late = store.push("w1", 0, {"a": g(100.0)}, step=0)
    assert not late.accepted and late.drop is DropReason.LATE
    for w, v in (("w1", 2.0), ("w2", 4.0), ("w0", 1000.0)):
        store.push(w, 1, {"a": g(v)}, step=2)
    # exactly K = 2 per step: w0's third push starts step 2 on its own
    assert store.version == 2 and value(store) == pytest.approx(3.0 + 3.0)
    assert store.stats().mode_stats["k_max_pushes_per_worker"] == 2


def test_k_batch_async_averages_the_first_k_arrivals_whatever_their_version() -> None:
    store = shard("k-batch-async:k=3")
    for w, base, v in (("w0", 0, 1.0), ("w0", 0, 2.0), ("w1", 0, 3.0)):
        assert store.wait_readable(w, 0, 0.0).readable
        store.push(w, base, {"a": g(v)}, step=int(v))
    assert store.version == 1 and value(store) == pytest.approx(2.0)
    for w, base, v in (("w2", 0, 10.0), ("w0", 1, 20.0), ("w2", 0, 30.0)):  # w2 twice, stale
        outcome = store.push(w, base, {"a": g(v)}, step=int(v))
        assert outcome.accepted and outcome.staleness == 1 - base
    assert store.version == 2 and value(store) == pytest.approx(2.0 + 20.0)
    assert store.stats().mode_stats["k_max_staleness"] == 1


def stage_and_vote(coord: ShardStore, follower: ShardStore, worker: str, base: int, v: float, step: int,
                   commit: bool = False) -> None:
    """One worker's coordinated push (client.coordinated_step): stage on the follower under its
    ballot, vote at shard 0, and with `commit` hand shard 0's decisions to the follower."""
    ballot = Ballot(base, coord.incarnation)
    assert follower.push(worker, base, {"b": g(v)}, follower.incarnation, step=step, ballot=ballot).accepted
    coord.push(worker, base, {"a": g(v)}, coord.incarnation, step=step, ballot=ballot)
    decisions = coord.decisions_since(base)
    if commit and decisions is not None:
        follower.commit(worker, ballot, decisions, step=step)


@pytest.mark.parametrize("spec", ["k-async:k=2", "k-batch-async:k=2"])
def test_a_follower_applies_a_stale_push_in_the_later_step_shard_0_put_it_in(spec: str) -> None:
    coord, follower = shard(spec), shard(spec, index=1, name="b")
    stage_and_vote(coord, follower, "w0", 0, 1.0, step=0)
    stage_and_vote(coord, follower, "w1", 0, 3.0, step=0, commit=True)  # step 0 made and committed
    stage_and_vote(coord, follower, "w2", 0, 10.0, step=0)  # computed from step 0, taken in step 1
    stage_and_vote(coord, follower, "w0", 1, 30.0, step=1)
    assert follower.version == 1 and coord.version == 2
    decisions = coord.decisions_since(0)
    assert decisions is not None and [sorted(s.workers) for s in decisions.steps] == [["w0#0", "w1#0"],
                                                                                    ["w0#1", "w2#0"]]
    outcome = follower.commit("w2", Ballot(0, coord.incarnation), decisions, step=0)
    assert outcome.accepted and outcome.version == 2 and outcome.staleness == 1
    assert follower.version == coord.version == 2
    assert value(follower, "b") == value(coord) == pytest.approx(2.0 + 20.0)


def test_a_k_batch_sync_follower_takes_two_pushes_of_one_worker_and_drops_the_interrupted_one() -> None:
    coord, follower = shard("k-batch-sync:k=2"), shard("k-batch-sync:k=2", index=1, name="b")
    stage_and_vote(coord, follower, "w1", 0, 100.0, step=0)  # w1 and w0 race; the step takes w0's two
    assert coord.version == 0
    coord_first = coord.decisions_since(0)
    assert coord_first is None
    # the same worker, same ballot, two mini-batches: both staged on the follower
    ballot = Ballot(0, coord.incarnation)
    for step, v in ((0, 1.0), (1, 5.0)):
        follower.push("w0", 0, {"b": g(v)}, follower.incarnation, step=step, ballot=ballot)
    coord.push("w0", 0, {"a": g(1.0)}, coord.incarnation, step=0, ballot=ballot)
    assert coord.version == 1 and value(coord) == pytest.approx(50.5)  # w1's 100 and w0's 1 came first
    coord.push("w0", 0, {"a": g(5.0)}, coord.incarnation, step=1, ballot=ballot)  # interrupted: late
    decisions = coord.decisions_since(0)
    assert decisions is not None and [sorted(s.workers) for s in decisions.steps] == [["w0#0", "w1#0"]]
    late = follower.commit("w0", ballot, decisions, step=1)
    assert not late.accepted and late.drop is DropReason.LATE
    assert follower.version == 1 and value(follower, "b") == pytest.approx(50.5)
    assert follower.stats().dropped_by_reason == coord.stats().dropped_by_reason == {"late": 1}


def test_a_k_batch_sync_follower_averages_one_workers_two_mini_batches() -> None:
    coord, follower = shard("k-batch-sync:k=2"), shard("k-batch-sync:k=2", index=1, name="b")
    stage_and_vote(coord, follower, "w0", 0, 1.0, step=0)
    stage_and_vote(coord, follower, "w0", 0, 5.0, step=1)  # same ballot: not a duplicate here
    decisions = coord.decisions_since(0)
    assert decisions is not None and [sorted(s.workers) for s in decisions.steps] == [["w0#0", "w0#1"]]
    follower.commit("w0", Ballot(0, coord.incarnation), decisions, step=1)
    assert follower.version == coord.version == 1
    assert value(follower, "b") == value(coord) == pytest.approx(3.0)
