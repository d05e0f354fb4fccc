"""Integer inputs end to end: int64 ids stay exact from the caller's arrays (or an npz file) to the model.

float32 holds every integer only up to 2**24; above it, ids round onto a neighbour's (2**24 + 1 becomes
2**24), so an id table would silently train the wrong row. The check: a saved model whose only signal is
whether it sees the id 2**24 + 1 exactly (an IntegerLookup of that one id, then a table whose row for it
is 1), fed through the same conversion `asyncps.train` and `npz:` datasets apply. Float inputs behave as
before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from asyncps.ml.datasets import Dataset, load_dataset
from asyncps.tools.api import _split_arrays

BIG_ID = 2**24 + 1  # the first integer float32 cannot hold


def id_model(path: Path) -> Path:
    """A saved model over one int64 id: its logits are nonzero only when it reads BIG_ID exactly."""
    import keras

    inputs = keras.Input(shape=(1,), dtype="int64", name="id")
    index = keras.layers.IntegerLookup(vocabulary=[BIG_ID], num_oov_indices=1, name="lookup")(inputs)
    table = keras.layers.Embedding(2, 1, embeddings_initializer="zeros", name="table")(index)
    outputs = keras.layers.Dense(2, kernel_initializer="ones", name="logits")(keras.layers.Flatten()(table))
    model = keras.Model(inputs, outputs)
    model.get_layer("table").embeddings.assign(np.array([[0.0], [1.0]], dtype=np.float32))
    model.save(path)
    return path


def through_train_arrays(x: Any, tmp_path: Path) -> Dataset:
    """x as asyncps.train hands it to every process: checked, saved to the run's npz, loaded as `npz:`."""
    y = np.zeros(len(x), dtype=np.int64)
    arrays = _split_arrays(None, x, y, (x, y), 0.0)
    assert arrays is not None
    path = tmp_path / "ids.npz"
    np.savez(path, x_train=arrays[0], y_train=arrays[1], x_test=arrays[2], y_test=arrays[3])
    return load_dataset(f"npz:{path}")


def test_an_id_above_2_24_reaches_the_model_exactly(tmp_path: Path) -> None:
    from asyncps.ml.models import build_model

    data = through_train_arrays(np.array([[BIG_ID], [BIG_ID - 2]]), tmp_path)
    assert data.x_train.dtype == np.int64 and data.x_train[0, 0] == BIG_ID
    assert data.id_rows == BIG_ID + 1
    model = build_model(f"keras:{id_model(tmp_path / 'm.keras')}", data.num_features, 2)
    assert str(model.inputs[0].dtype) == "int64"  # the wrapper reads what the saved model reads
    logits = np.asarray(model(data.x_train, training=False))
    np.testing.assert_array_equal(logits, [[1.0, 1.0], [0.0, 0.0]])  # float32 would have made row 0 zero too


def test_float_inputs_behave_as_before(tmp_path: Path) -> None:
    x = np.array([[0.25, 1.5], [2.0, -3.0]], dtype=np.float64)
    data = through_train_arrays(x, tmp_path)
    assert data.x_train.dtype == np.float32 and data.id_rows == 0
    np.testing.assert_array_equal(data.x_train, x.astype(np.float32))  # not rescaled


def test_npz_uint8_images_still_scale(tmp_path: Path) -> None:
    path = tmp_path / "images.npz"
    pixels = np.array([[[0, 255]], [[51, 102]]], dtype=np.uint8)
    np.savez(path, x_train=pixels, y_train=np.array([0, 1]), x_test=pixels, y_test=np.array([1, 0]))
    data = load_dataset(f"npz:{path}")
    assert data.x_train.dtype == np.float32
    np.testing.assert_allclose(data.x_train, [[0.0, 1.0], [0.2, 0.4]], rtol=1e-6)


def test_dataset_validates_int_ids() -> None:
    ids, y = np.array([[1, 2], [3, 4]], dtype=np.int64), np.array([0, 1], dtype=np.int64)
    assert Dataset("ids", ids, y, ids, y, num_classes=2, image_shape=None).id_rows == 5
    assert Dataset("ids", ids, y, ids, y, num_classes=2, image_shape=None, num_ids=10).id_rows == 10
    with pytest.raises(ValueError, match="int64 ids"):
        Dataset("bad", ids.astype(np.int32), y, ids.astype(np.int32), y, num_classes=2, image_shape=None)
    with pytest.raises(ValueError, match="negative id"):
        Dataset("bad", -ids, y, ids, y, num_classes=2, image_shape=None)
    with pytest.raises(ValueError, match="outside num_ids 4"):
        Dataset("bad", ids, y, ids, y, num_classes=2, image_shape=None, num_ids=4)
    with pytest.raises(ValueError, match="x_test float32"):
        Dataset("bad", ids, y, ids.astype(np.float32), y, num_classes=2, image_shape=None)


def test_a_float_model_takes_int_batches() -> None:
    """A built-in float model fed int64 features (a worker's batch of an integer dataset) casts them, as before."""
    import tensorflow as tf

    from asyncps.ml.models import build_model

    model = build_model("mlp:8", 3, 2, seed=1)
    ints = np.array([[1, 2, 3]], dtype=np.int64)
    values = [v.value for v in model.trainable_variables]
    as_int, _ = model.stateless_call(values, [], tf.constant(ints), training=False)
    np.testing.assert_array_equal(np.asarray(as_int), np.asarray(model(ints.astype(np.float32))))
