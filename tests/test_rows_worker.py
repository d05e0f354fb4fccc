"""A worker reading its tables by rows computes exactly what it computes reading them whole.

The worker's side of row reads (asyncps.ml.sparse: the model cloned with local tables; ModelClient's
row reads; the Trainer's step) over shards' stores in this process, behind the smallest data path that
calls the store as the servers do: the same seeded steps with one worker, tables read by rows and read
whole, end in the same parameters (1 and 2 shards, every optimizer with slots). The wire's part is
tested per path (tests/test_rows_wire.py) and end to end (tests/test_rows_e2e.py).
"""

from __future__ import annotations

import resource
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

pytest.importorskip("tensorflow")

import keras
from asyncps.ps.store import ShardStore
from asyncps.worker.trainer import BatchStream, Telemetry, Trainer, make_grad_fn

from asyncps.delays import NoDelay, StepDelay
from asyncps.ml.models import build_model, loss_fn
from asyncps.ml.sparse import build_deferred, plan
from asyncps.placement import VariableSpec, place, split_for_shards
from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.transport import ModelClient
from asyncps.wire.codec import Array, IndexArray
from asyncps.wire.shard import PushOutcome, PushRequest, ShardValues


class StorePath:
    """A shard's data path that calls its store directly (what every server does after decoding)."""

    def __init__(self, store: ShardStore) -> None:
        self.store = store
        self.row_reads = 0
        self.whole_reads: set[str] = set()

    def _read(self, worker_id: str, since: int, rows: Mapping[str, IndexArray] | None) -> ShardValues:
        reply = self.store.pull(since, worker_id, rows=rows)
        self.row_reads += bool(reply.rows)
        self.whole_reads |= set(reply.values or {})
        return reply

    def pull(self, worker_id: str, if_newer_than: int = -1, buffers: Mapping[str, Array] | None = None,
             wait_timeout_s: float = 0.0, rows: Mapping[str, IndexArray] | None = None) -> ShardValues:
        return self._read(worker_id, if_newer_than, rows)

    def push(self, request: PushRequest) -> PushOutcome:
        return self.store.push(request.worker_id, request.base_version, request.grads, request.incarnation,
                               request.step, request.ballot, request.worker_index)

    def push_pull(self, request: PushRequest, pull_if_newer_than: int = -1,
                  buffers: Mapping[str, Array] | None = None, read_wait_s: float = 0.0,
                  rows: Mapping[str, IndexArray] | None = None) -> tuple[PushOutcome, ShardValues]:
        return self.push(request), self._read(request.worker_id, pull_if_newer_than, rows)

    def close(self) -> None:
        pass


def ids_model(rows: int, table: Any = keras.layers.Embedding) -> Any:
    """Ids straight into a table (the recommendation shape; `table` the layer: an Embedding, or a HashEmbedding
    keyed on the shards), and a small head."""
    inputs = keras.Input((4,), dtype="int64", name="ids")
    x = table(rows, 8, embeddings_initializer=keras.initializers.RandomUniform(-0.1, 0.1, seed=3),
              name="table")(inputs)
    x = keras.layers.Flatten(name="flat")(x)
    x = keras.layers.Dense(16, activation="relu", kernel_initializer=keras.initializers.GlorotUniform(seed=4),
                           name="hidden")(x)
    logits = keras.layers.Dense(2, kernel_initializer=keras.initializers.GlorotUniform(seed=5), name="logits")(x)
    return keras.Model(inputs, logits, name="ids_model")


def train(model: Any, sparse: Any, values: dict[str, Array], shards: int, optimizer: str,
          x: Array, y: Array, steps: int = 12) -> tuple[dict[str, Array], list[StorePath]]:
    """`steps` seeded steps of one worker on fresh shards holding `values`; the shards' values after."""
    specs = sparse.specs() if sparse is not None else [
        VariableSpec(v.path, tuple(v.shape), str(v.dtype)) for v in model.trainable_variables]
    placement = place(specs, shards, slice_threshold_bytes=1024)
    rule = UpdateRuleConfig(OptimizerConfig(optimizer, 0.05))
    paths = []
    for index, part in enumerate(split_for_shards(placement, values)):
        store = ShardStore(index)
        store.initialize(rule, {k: np.ascontiguousarray(v) for k, v in part.items()})
        paths.append(StorePath(store))
    tables = [t.variable for t in sparse.tables] if sparse is not None else []
    client = ModelClient("w", paths, placement, row_variables=tables)  # type: ignore[arg-type]
    names = [v.path for v in model.trainable_variables]
    trainer = Trainer(client, names, make_grad_fn(model, loss_fn, fed=sparse.fed if sparse else ()),
                      BatchStream(x, y, 16, seed=1),
                      StepDelay(NoDelay()), Telemetry(), sparse=sparse)
    trainer.run(threading.Event(), max_steps=steps)
    out = {}
    for part in placement.parts:
        value = paths[part.shard].store.values()[part.name]
        out.setdefault(part.variable, []).append(value)
    return {k: np.concatenate(v) if len(v) > 1 else v[0] for k, v in out.items()}, paths


@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adagrad", "adam"])
def test_rows_read_by_id_train_exactly_what_the_whole_table_trains(shards: int, optimizer: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 300, size=(64, 4)).astype(np.int64)
    y = rng.integers(0, 2, size=64).astype(np.int64)
    whole_model = ids_model(300)
    start = {v.path: np.array(v.numpy()) for v in whole_model.trainable_variables}
    sparse = plan(build_deferred(lambda: ids_model(300)), batch_size=16)
    assert sparse is not None and [t.variable for t in sparse.tables] == ["table/embeddings"]
    by_rows, paths = train(sparse.model, sparse, start, shards, optimizer, x, y)
    whole, _ = train(whole_model, None, start, shards, optimizer, x, y)
    assert all(p.row_reads for p in paths if any(n.startswith("table/") for n in p.store.values()))
    assert not any("table/" in n for p in paths for n in p.whole_reads), "a table was sent whole"
    for name in whole:
        np.testing.assert_allclose(by_rows[name], whole[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert not np.array_equal(whole["table/embeddings"], start["table/embeddings"])


def test_the_built_in_embedding_model_reads_its_ids_from_the_models_own_tokenizer() -> None:
    """Ids the model computes (the built-in model quantizes features into tokens) are found by its prefix."""
    rng = np.random.default_rng(1)
    x = rng.random((64, 10)).astype(np.float32)
    y = rng.integers(0, 3, size=64).astype(np.int64)
    whole_model = build_model("embedding", 10, 3, seed=7)
    start = {v.path: np.array(v.numpy()) for v in whole_model.trainable_variables}
    sparse = plan(build_deferred(lambda: build_model("embedding", 10, 3, seed=7)), batch_size=16)
    assert sparse is not None
    by_rows, _ = train(sparse.model, sparse, start, 2, "adagrad", x, y)
    whole, _ = train(whole_model, None, start, 2, "adagrad", x, y)
    for name in whole:
        np.testing.assert_allclose(by_rows[name], whole[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_worker_never_makes_a_table_it_reads_by_rows() -> None:
    """A 10M-row table (1.2 GiB of float32) costs the worker's process next to nothing."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    sparse = plan(build_deferred(lambda: ids_model(10_000_000)), batch_size=64)
    assert sparse is not None
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert sparse.specs()[0].shape == (10_000_000, 8)
    assert tuple(sparse.model.trainable_variables[0].shape) == (256, 8)
    assert grown_mb < 100, f"peak memory grew {grown_mb:.0f} MB"


def test_a_batch_with_an_id_outside_the_table_is_a_clear_error() -> None:
    sparse = plan(build_deferred(lambda: ids_model(50)), batch_size=4)
    assert sparse is not None
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 50\)"):
        sparse.batch_ids(np.array([[1, 2, 3, 50]], dtype=np.int64))


def test_a_saved_model_s_nested_table_is_read_by_rows_too(tmp_path: Any) -> None:
    """asyncps.train hands a saved model over (`keras:PATH`), wrapped for flat features: the table sits in a
    nested model, and is read by rows all the same."""
    path = tmp_path / "user.keras"
    ids_model(300).save(path)
    rng = np.random.default_rng(2)
    x = rng.integers(0, 300, size=(64, 4)).astype(np.int64)
    y = rng.integers(0, 2, size=64).astype(np.int64)
    whole_model = build_model(f"keras:{path}", 4, 2)
    start = {v.path: np.array(v.numpy()) for v in whole_model.trainable_variables}
    sparse = plan(build_deferred(lambda: build_model(f"keras:{path}", 4, 2)), batch_size=16)
    assert sparse is not None and len(sparse.tables) == 1
    by_rows, _ = train(sparse.model, sparse, start, 2, "adam", x, y)
    whole, _ = train(whole_model, None, start, 2, "adam", x, y)
    for name in whole:
        np.testing.assert_allclose(by_rows[name], whole[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_sequential_model_s_table_is_read_by_rows() -> None:
    model = keras.Sequential([keras.Input((3,), dtype="int64"), keras.layers.Embedding(40, 4, name="seq_table"),
                              keras.layers.Flatten(), keras.layers.Dense(2)], name="seq")
    sparse = plan(model, batch_size=8)
    assert sparse is not None and sparse.tables[0].capacity == 24
    assert sparse.batch_ids(np.array([[1, 5, 5], [39, 0, 1]], dtype=np.int64))["seq/seq_table/embeddings"].tolist() == [
        0, 1, 5, 39]


def test_a_model_that_cannot_be_built_without_its_tables_is_built_with_them(tmp_path: Any) -> None:
    """A saved model compiled with its optimizer makes variables from values when loaded, which Keras refuses
    without making them: it is built as usual, and its tables are read by rows all the same."""
    path = tmp_path / "compiled.keras"
    model = ids_model(100)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.save(path)
    sparse = plan(build_deferred(lambda: build_model(f"keras:{path}", 4, 2)), batch_size=8)
    assert sparse is not None and sparse.tables[0].shape == (100, 8)


@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adagrad", "adam"])
def test_a_keyed_table_trains_exactly_what_a_whole_table_of_the_same_rows_trains(shards: int, optimizer: str) -> None:
    """Keys 0..299 into a HashEmbedding with room for every key: rows made at their keys by the shards, trained by
    key, end where a positional table starting from the same rows ends."""
    from asyncps.chief.checkpointer import generated_parts

    rng = np.random.default_rng(0)
    x = rng.integers(0, 300, size=(64, 4)).astype(np.int64)
    y = rng.integers(0, 2, size=64).astype(np.int64)
    from asyncps.ml.sparse import HashEmbedding

    sparse = plan(build_deferred(lambda: ids_model(300 * shards, HashEmbedding)), batch_size=16)
    assert sparse is not None and sparse.tables[0].keyed and sparse.tables[0].init is not None
    init = sparse.tables[0].init
    whole_model = ids_model(300)
    start = {v.path: np.array(v.numpy()) for v in whole_model.trainable_variables}
    start["table/embeddings"] = init.rows(0, 300, (8,), np.float32)  # what the shards make at keys 0..299
    whole, _ = train(whole_model, None, start, shards, optimizer, x, y)

    placement = place(sparse.specs(), shards, slice_threshold_bytes=1024)
    assert all(p.keyed for p in placement.parts_of("table/embeddings"))
    rule = UpdateRuleConfig(OptimizerConfig(optimizer, 0.05))
    paths = []
    for index, part in enumerate(split_for_shards(placement, start)):
        store = ShardStore(index)
        store.initialize(rule, {k: np.ascontiguousarray(v) for k, v in part.items() if not k.startswith("table/")},
                         generated=generated_parts(placement, index, {"table/embeddings": init}))
        paths.append(StorePath(store))
    client = ModelClient("w", paths, placement, row_variables=["table/embeddings"])  # type: ignore[arg-type]
    names = [v.path for v in sparse.model.trainable_variables]
    trainer = Trainer(client, names, make_grad_fn(sparse.model, loss_fn, fed=sparse.fed), BatchStream(x, y, 16, seed=1),
                      StepDelay(NoDelay()), Telemetry(), sparse=sparse)
    trainer.run(threading.Event(), max_steps=12)
    assert not any("table/" in n for p in paths for n in p.whole_reads), "a keyed table was sent whole"
    client.pull(rows={"table/embeddings": np.arange(300, dtype=np.int64)})
    np.testing.assert_allclose(client.rows["table/embeddings"].values, whole["table/embeddings"], rtol=1e-5,
                               atol=1e-6)
    for name in whole:
        if name != "table/embeddings":
            np.testing.assert_allclose(client.values[name], whole[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert not np.array_equal(whole["table/embeddings"], start["table/embeddings"])
