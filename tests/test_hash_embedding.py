"""asyncps.HashEmbedding, the Keras side of a keyed table: a plain-Keras layer (the hashing trick) that a worker
reads by key from the shards; the recsys model and dataset's keyed and hashed options; the runs that cannot
read a keyed table by rows refused with a reason."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tensorflow")

import keras

import asyncps
from asyncps.config import RunConfig
from asyncps.ml.datasets import load_dataset
from asyncps.ml.sparse import HashEmbedding, build_deferred, plan
from asyncps.runmodel import build_chief_model, build_worker_model

BIG = np.iinfo(np.int64).max


def keyed_model(initializer: str | keras.initializers.Initializer = "uniform") -> keras.Model:
    inputs = keras.Input((3,), dtype="int64")
    x = asyncps.HashEmbedding(1000, 4, embeddings_initializer=initializer, name="ids")(inputs)
    x = keras.layers.Flatten()(x)
    return keras.Model(inputs, keras.layers.Dense(2, name="logits")(x))


def test_outside_asyncps_it_is_the_hashing_trick_and_it_saves_and_loads(tmp_path: Path) -> None:
    assert asyncps.HashEmbedding is HashEmbedding
    model = keyed_model()
    layer = model.get_layer("ids")
    keys = np.array([[5, 1005, -995]], np.int64)  # all the same row: 5 mod 1000
    out = np.asarray(layer(keys))
    np.testing.assert_array_equal(out[0, 0], out[0, 1])
    np.testing.assert_array_equal(out[0, 0], out[0, 2])
    np.testing.assert_array_equal(out[0, 0], np.asarray(layer.embeddings)[5])
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    again = loaded.get_layer("ids")
    assert isinstance(again, HashEmbedding) and again.rows == 1000
    np.testing.assert_array_equal(np.asarray(loaded(keys)), np.asarray(model(keys)))


def test_a_worker_reads_it_by_key_with_room_for_a_batchs_keys_whatever_its_rows() -> None:
    sparse = plan(build_deferred(lambda: keyed_model()), batch_size=512, seed=1)
    assert sparse is not None
    (table,) = sparse.tables
    assert table.keyed and table.shape == (1000, 4) and table.capacity == 512 * 3 and table.init is not None
    assert [s.keyed for s in sparse.specs() if s.name == table.variable] == [True]
    ids = sparse.batch_ids(np.array([[-1, BIG, 7], [7, 1 << 50, -(1 << 60)]], np.int64))
    np.testing.assert_array_equal(ids[table.variable], np.unique([-1, BIG, 7, 1 << 50, -(1 << 60)]))


def test_a_keyed_table_whose_initializer_the_shards_cannot_make_is_refused() -> None:
    with pytest.raises(ValueError, match=r"HashEmbedding tables live on the shards by key.*initializer"):
        plan(build_deferred(lambda: keyed_model("glorot_uniform")), batch_size=32)


@pytest.mark.parametrize(("settings", "why"), [
    ({"row_pull": "off"}, "--row-pull off"),
    ({"pipeline": True}, "--pipeline"),
])
def test_a_run_that_reads_tables_whole_refuses_a_keyed_table(settings: dict[str, object], why: str) -> None:
    run = RunConfig(model="recsys:keyed=1,dim=4", dataset="recsys:rows=500,hashed=1,train=64,test=16", **settings)
    with pytest.raises(ValueError, match=f"HashEmbedding cannot train with {why}"):
        build_worker_model(run)
    if settings.get("row_pull") == "off":
        with pytest.raises(ValueError, match="HashEmbedding cannot train with --row-pull off"):
            build_chief_model(run, 256)


def test_hashed_recsys_ids_are_int64_keys_of_any_value_with_the_same_labels() -> None:
    plain = load_dataset("recsys:rows=500,train=400,test=100", 4)
    hashed = load_dataset("recsys:rows=500,train=400,test=100,hashed=1", 4)
    assert hashed.x_train.dtype == np.int64 and hashed.x_train.min() < 0 and hashed.x_train.max() > 1 << 40
    np.testing.assert_array_equal(hashed.y_train, plain.y_train)
    assert np.unique(hashed.x_train).size == np.unique(plain.x_train).size  # a bijection of the ids
    assert hashed.id_rows == 500


def test_the_recsys_model_is_keyed_on_request_and_bad_options_are_refused() -> None:
    _, _, sparse = build_worker_model(RunConfig(model="recsys:keyed=1,rows=300,dim=4",
                                                dataset="recsys:rows=500,hashed=1,train=64,test=16"))
    assert sparse is not None and sparse.tables[0].keyed and sparse.tables[0].shape == (300, 4)
    with pytest.raises(ValueError, match="keyed 0 or 1"):
        build_worker_model(RunConfig(model="recsys:keyed=2", dataset="recsys:rows=500"))
    with pytest.raises(ValueError, match="hashed 0 or 1"):
        load_dataset("recsys:rows=500,hashed=3")


def test_asyncps_train_refuses_a_keyed_model_and_says_what_runs_it(tmp_path: Path) -> None:
    x = np.arange(30, dtype=np.int64).reshape(10, 3)
    with pytest.raises(ValueError, match=r"HashEmbedding.*asyncps local --model package\.module:function"):
        asyncps.train(model=keyed_model(), x=x, y=np.zeros(10, np.int64), validation_split=0.2,
                      run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_an_exported_keyed_table_looks_up_the_rows_kept_and_zeros_for_other_keys(tmp_path: Path) -> None:
    from asyncps.ml.sparse import KeyedTable, with_kept_rows

    model = keyed_model()
    table = model.get_layer("ids").embeddings.path
    values = {v.path: np.asarray(v) for v in model.trainable_variables}
    values[table] = np.arange(1000 * 4, dtype=np.float32).reshape(1000, 4)
    keys = np.zeros(1000, np.int64)
    touched = np.full(1000, -1, np.int64)
    keys[[7, 3, 500]] = [BIG, -(1 << 40), 12]  # three places kept, in no order; the rest free
    touched[[7, 3, 500]] = [1, 2, 3]
    exported = with_kept_rows(model, values, {table: {"keyed.keys": keys, "keyed.touched": touched}})
    kept = exported.get_layer("ids")
    assert isinstance(kept, KeyedTable) and kept.size == 3
    np.testing.assert_array_equal(np.asarray(kept.keys), [-(1 << 40), 12, BIG])
    out = np.asarray(kept(np.array([[12, BIG, 99]], np.int64)))
    np.testing.assert_array_equal(out[0], [values[table][500], values[table][7], np.zeros(4)])
    np.testing.assert_array_equal(np.asarray(exported.get_layer("logits").kernel), values["logits/kernel"])
    exported.save(tmp_path / "m.keras")
    again = keras.models.load_model(tmp_path / "m.keras")
    x = np.array([[-(1 << 40), 12, 5]], np.int64)
    np.testing.assert_array_equal(np.asarray(again(x)), np.asarray(exported(x)))
    with pytest.raises(ValueError, match="no keys for this HashEmbedding"):
        with_kept_rows(model, values, {})
