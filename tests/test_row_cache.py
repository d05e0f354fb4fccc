"""A worker's row cache (asyncps.transport.rowcache) serves only rows its shards served, within S versions.

Clients over shards' stores in this process (tests/test_rows_worker.py's StorePath): one worker reads with
the cache, one without it reads every row each round (the reference: every state of every row), and a
third pushes updates between the rounds. The end-to-end run with the cache is tests/test_rows_e2e.py's.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from asyncps.ps.store import ShardStore

from asyncps.placement import VariableSpec, place, split_for_shards
from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.transport import ModelClient
from asyncps.transport.rowcache import ROW_OVERHEAD_BYTES
from asyncps.wire.codec import SparseRows
from tests.test_rows_worker import StorePath

TABLE = "table/embeddings"
ROWS, DIM = 300, 8


def clients(staleness: int, max_rows: int = ROWS) -> tuple[ModelClient, ModelClient, ModelClient]:
    """(cached, reference, pusher): three workers' clients over the same two shards, the table sliced over both."""
    placement = place([VariableSpec(TABLE, (ROWS, DIM), "float32")], 2, slice_threshold_bytes=1024)
    start = np.random.default_rng(0).normal(size=(ROWS, DIM)).astype(np.float32)
    paths = []
    for index, part in enumerate(split_for_shards(placement, {TABLE: start})):
        store = ShardStore(index)
        store.initialize(UpdateRuleConfig(OptimizerConfig("sgd", 0.1)), part)
        paths.append(StorePath(store))

    def client(name: str) -> ModelClient:
        return ModelClient(name, paths, placement, row_variables=[TABLE])  # type: ignore[arg-type]

    cached = client("cached")
    cached.use_row_cache(staleness, {TABLE: max_rows})
    return cached, client("reference"), client("pusher")


def push(pusher: ModelClient, ids: Any, step: int) -> None:
    """One update of rows `ids` (a push to each shard holding some of them)."""
    ids = np.unique(np.asarray(ids, dtype=np.int64))
    grad = SparseRows(ids, np.ones((ids.size, DIM), dtype=np.float32), None)
    pusher.push_pull({TABLE: grad}, step, 0.0)


def test_a_cached_row_is_a_row_its_shard_served_at_most_s_versions_before() -> None:
    staleness = 2
    cached, reference, pusher = clients(staleness)
    pusher.pull()
    every = {TABLE: np.arange(ROWS, dtype=np.int64)}
    seen: dict[tuple[int, int], tuple[Any, int]] = {}  # (id, clock) -> (values, the last version it was read at)
    rng = np.random.default_rng(1)
    parts = cached.placement.parts_of(TABLE)

    def shard_of(i: int) -> int:
        return next(p.shard for p in parts if p.row_start <= i < p.row_stop)

    for step in range(40):
        push(pusher, rng.integers(0, ROWS, size=rng.integers(1, 6)), step)
        reference.pull(rows=every)
        ref = reference.rows[TABLE]
        for i, (value, clock) in enumerate(zip(ref.values, ref.clocks, strict=True)):
            seen[(i, int(clock))] = (value.copy(), reference.versions[shard_of(i)])
        last_seen = list(cached.versions)
        ids = np.unique(np.concatenate([np.arange(10), rng.integers(0, ROWS, size=20)])).astype(np.int64)
        cached.pull(rows={TABLE: ids})
        got = cached.rows[TABLE]
        np.testing.assert_array_equal(got.indices, ids)
        for i, value, clock in zip(got.indices.tolist(), got.values, got.clocks.tolist(), strict=True):
            served, version = seen[(i, clock)]  # a state of the row the shard served
            np.testing.assert_array_equal(value, served)
            assert last_seen[shard_of(i)] <= version + staleness, (i, clock, last_seen, version)
    counts = cached.row_cache.counts if cached.row_cache is not None else None
    assert counts is not None and 0 < counts.hits < counts.rows
    assert counts.bytes_saved == counts.hits * (DIM * 4 + ROW_OVERHEAD_BYTES)


def test_a_row_is_read_again_once_its_shard_moved_more_than_s_versions() -> None:
    staleness = 2
    cached, reference, pusher = clients(staleness)
    pusher.pull()
    row, other = {TABLE: np.array([3], dtype=np.int64)}, [7]  # both in one part: on one shard
    cached.pull(rows=row)
    assert cached.row_cache is not None and cached.row_cache.counts.hits == 0
    for step in range(staleness + 1):  # the shard moves on; the cached row is within S of what was last seen
        push(pusher, other, step)
        cached.pull(rows=row)
        assert cached.row_cache.counts.hits == step + 1
    push(pusher, [3], staleness + 1)
    cached.pull(rows=row)  # last seen: S + 1 versions past the read: asked again
    assert cached.row_cache.counts.hits == staleness + 1
    reference.pull(rows=row)
    np.testing.assert_array_equal(cached.rows[TABLE].values, reference.rows[TABLE].values)
    np.testing.assert_array_equal(cached.rows[TABLE].clocks, reference.rows[TABLE].clocks)


def test_the_cache_keeps_at_most_its_rows_dropping_the_least_recently_used() -> None:
    cached, _, pusher = clients(staleness=5, max_rows=4)
    pusher.pull()
    cached.pull(rows={TABLE: np.array([1, 2, 3, 4], dtype=np.int64)})
    cached.pull(rows={TABLE: np.array([1, 2], dtype=np.int64)})  # 3 and 4 now the least recently used
    cached.pull(rows={TABLE: np.array([1, 5, 6], dtype=np.int64)})  # 5 and 6 take 3's and 4's slots
    assert cached.row_cache is not None
    hits = cached.row_cache.counts.hits
    cached.pull(rows={TABLE: np.array([2, 3, 5], dtype=np.int64)})
    assert cached.row_cache.counts.hits - hits == 2  # 2 and 5 held, 3 read again


def test_a_cache_of_s_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="S >= 1"):
        clients(staleness=0)


@pytest.mark.parametrize("staleness", [0, 4])
def test_a_single_worker_pushes_cached_rows_with_the_clocks_they_were_read_at(staleness: int) -> None:
    """One worker alone: without a cache every row it pushes is fresh (per-row staleness 0); with one, a row
    served from the cache carries the clock it was read at, so the shard measures the updates it missed:
    at most S past the version the worker last saw when it asked, and the one push of that round trip."""
    from asyncps.worker.trainer import BatchStream, Telemetry, Trainer, make_grad_fn

    from asyncps.delays import NoDelay, StepDelay
    from asyncps.ml.models import loss_fn
    from asyncps.ml.sparse import build_deferred, plan
    from tests.test_rows_worker import ids_model

    rng = np.random.default_rng(0)
    x = rng.integers(0, 20, size=(64, 4)).astype(np.int64)  # few ids: rows repeat from step to step
    y = rng.integers(0, 2, size=64).astype(np.int64)
    sparse = plan(build_deferred(lambda: ids_model(300)), batch_size=16)
    assert sparse is not None
    model = ids_model(300)
    values = {v.path: np.array(v.numpy()) for v in model.trainable_variables}
    placement = place(sparse.specs(), 1)
    store = ShardStore(0)
    store.initialize(UpdateRuleConfig(OptimizerConfig("sgd", 0.05)), values)
    client = ModelClient("w", [StorePath(store)], placement, row_variables=[TABLE])  # type: ignore[list-item]
    if staleness:
        client.use_row_cache(staleness, {TABLE: 300})
    telemetry = Telemetry()
    trainer = Trainer(client, [v.path for v in sparse.model.trainable_variables],
                      make_grad_fn(sparse.model, loss_fn, fed=sparse.fed), BatchStream(x, y, 16, seed=1),
                      StepDelay(NoDelay()), telemetry, sparse=sparse)
    trainer.run(threading.Event(), max_steps=12)
    pushes, steps = telemetry.drain()
    worst = max(p.row_staleness_max for p in pushes)
    cached = sum(s.rows_cached for s in steps)
    if staleness:
        # S versions past the read as last seen, plus the worker's own push of the round trip that asked
        assert cached > 0 and 1 <= worst <= staleness + 1, (cached, worst)
    else:
        assert cached == 0 and worst == 0
