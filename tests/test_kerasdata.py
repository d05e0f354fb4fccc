"""asyncps.train's data beyond arrays (asyncps.tools.kerasdata): a tf.data.Dataset, a keras.utils.PyDataset, a
generator or a function returning one, read into the arrays the run sends, and each mistake refused with what to
do before any process starts. The runs that train from them (every example once per epoch) are in
tests/test_train_api.py."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import asyncps
from asyncps.tools import kerasdata

X = np.arange(70, dtype=np.float32).reshape(35, 2)
Y = (np.arange(35) % 3).astype(np.int64)


class Batches(keras.utils.PyDataset):  # type: ignore[misc]  # keras is untyped
    """X, Y in batches of 8 (the last one 3), as a user's PyDataset serves them."""

    def __init__(self, endless: bool = False) -> None:
        super().__init__()
        self.endless = endless

    def __len__(self) -> int:
        return 5

    @property
    def num_batches(self) -> int | None:
        return None if self.endless else 5

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return X[8 * i:8 * i + 8], Y[8 * i:8 * i + 8]


def generate() -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for i in range(0, 35, 8):
        yield X[i:i + 8], Y[i:i + 8]


@pytest.mark.parametrize("source", [
    pytest.param(lambda: tf.data.Dataset.from_tensor_slices((X, Y)).batch(8), id="tf.data"),
    pytest.param(Batches, id="PyDataset"),
    pytest.param(lambda: generate(), id="generator"),
    pytest.param(lambda: generate, id="generator-function"),
    pytest.param(lambda: iter(list(generate())), id="iterator"),
])
def test_every_source_reads_as_the_arrays_it_was_made_from(source: Any) -> None:
    x, y, w = kerasdata.read(source(), "x")
    assert w is None
    np.testing.assert_array_equal(x, X)
    np.testing.assert_array_equal(y, Y)
    assert x.dtype == X.dtype and y.dtype == Y.dtype  # integers stay integers (ids above 2**24 exact)


def test_batches_of_several_inputs_and_outputs_read_as_model_fit_reads_them() -> None:
    """A dict of inputs (by name) or a list (in the model's order), and several labels, joined key by key."""
    ids = np.arange(35, dtype=np.int64)
    x, y, _ = kerasdata.read(tf.data.Dataset.from_tensor_slices(({"ids": ids, "dense": X}, Y)).batch(8), "x")
    assert isinstance(x, dict) and sorted(x) == ["dense", "ids"]
    assert np.array_equal(x["ids"], ids) and np.array_equal(x["dense"], X) and np.array_equal(y, Y)
    assert x["ids"].dtype == np.int64
    x, y, _ = kerasdata.read(iter([([ids[:20], X[:20]], [Y[:20], X[:20, :1]]), ([ids[20:], X[20:]],
                                                                               [Y[20:], X[20:, :1]])]), "x")
    assert isinstance(x, list) and isinstance(y, list) and len(x) == len(y) == 2
    assert np.array_equal(x[1], X) and np.array_equal(y[0], Y) and y[1].shape == (35, 1)


def test_arrays_and_specs_are_not_sources() -> None:
    assert all(kerasdata.kind(s) is None for s in (X, [1, 2], (X, Y), None, {"a": X}))


@pytest.mark.parametrize(("source", "message"), [
    (tf.data.Dataset.from_tensor_slices((X, Y)).batch(8).repeat(), r"infinite tf.data.Dataset .*take\(batches\)"),
    (Batches(endless=True), "PyDataset without a length"),
    (tf.data.Dataset.from_tensor_slices((X, Y)), "not batched"),
    (iter([(X[:4], Y[:4], np.ones(4)), (X[4:8], Y[4:8])]), "lacks sample weights and batch 0 does not"),
    (iter([(X[:4], Y[:4], np.ones(3))]), r"\(3,\) sample weights"),
    (iter([({"a": X[:4]}, Y[:4]), ({"b": X[4:8]}, Y[4:8])]), r"batch 1 of x has examples of shape \{'b'"),
    (tf.data.Dataset.from_tensor_slices(X).batch(8), r"not an \(x, y\) pair"),
    (iter([(X[:4], Y[:3])]), r"\[3, 4\] examples across its inputs and labels"),
    (iter([([X[:4], X[:3]], Y[:4])]), r"\[3, 4\] examples across its inputs and labels"),
    (iter([(X[:4], Y[:4]), (np.zeros((4, 3)), Y[:4])]), r"batch 1 of x has examples of shape \(3,\)"),
    (iter([]), "no batches"),
    (lambda: 7, "returned int"),
])
def test_a_source_that_cannot_be_read_is_refused_with_what_to_do(source: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kerasdata.read(source, "x")


def test_batches_with_sample_weights_bring_them() -> None:
    weights = np.linspace(0.0, 2.0, 35).astype(np.float32)
    x, y, w = kerasdata.read(tf.data.Dataset.from_tensor_slices((X, Y, weights)).batch(8), "x")
    np.testing.assert_array_equal(x, X)
    np.testing.assert_array_equal(y, Y)
    assert w is not None and w.dtype == np.float32
    np.testing.assert_allclose(w, weights)


def test_an_endless_generator_is_refused_not_read_forever(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kerasdata, "MAX_EXAMPLES", 100)
    with pytest.raises(ValueError, match=r"had not ended after 100 examples: give a finite one \(itertools.islice"):
        kerasdata.read(itertools.repeat((X[:8], Y[:8])), "x")


def test_train_refuses_labels_beside_a_dataset_before_any_process(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="do not give y= as well"):
        asyncps.train(model="mlp", x=tf.data.Dataset.from_tensor_slices((X, Y)).batch(8), y=Y,
                      validation_split=0.2, run_dir=tmp_path / "run")
    with pytest.raises(ValueError, match=r"infinite tf\.data\.Dataset"):
        asyncps.train(model="mlp", x=X, y=Y, run_dir=tmp_path / "run",
                      validation_data=tf.data.Dataset.from_tensor_slices((X, Y)).batch(8).repeat())
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"sample_weight": np.ones(34)}, r"one number per example \(35\)"),
    ({"sample_weight": -np.ones(35)}, "finite and >= 0"),
    ({"class_weight": {0: 1.0}, "y": X[:, 0]}, "class_weight= needs integer class ids"),
    ({"class_weight": {-1: 1.0}}, "not a class id"),
    ({"sample_weight": np.ones(35), "dataset": "digits", "x": None, "y": None}, "not a dataset= spec"),
    ({"x": tf.data.Dataset.from_tensor_slices((X, Y, np.ones(35))).batch(8), "y": None, "sample_weight": np.ones(35)},
     "do not give sample_weight="),
])
def test_bad_weights_are_refused_before_any_process(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    given = {"x": X, "y": Y, "validation_split": 0.2, **kwargs}
    with pytest.raises(ValueError, match=message):
        asyncps.train(model="mlp", run_dir=tmp_path / "run", **given)
    assert not (tmp_path / "run").exists()


def test_weighted_losses_reduce_as_keras_reduces_them() -> None:
    """sum(w * loss) / batch size, for the built-in loss, a Keras loss object (given the weights) and a Keras
    loss function (per example, weighted here); weights of 1 give the unweighted mean."""
    from asyncps.ml.models import loss_fn
    from asyncps.ml.task import make_loss

    logits = tf.constant(np.random.default_rng(0).normal(size=(6, 3)).astype(np.float32))
    labels = tf.constant(np.array([0, 1, 2, 0, 1, 2]))
    w = tf.constant(np.array([0.0, 1.0, 2.0, 0.5, 0.0, 3.0], dtype=np.float32))
    per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits).numpy()
    want = float(np.sum(per * w.numpy()) / 6)
    assert float(loss_fn(logits, labels, w)) == pytest.approx(want, rel=1e-6)
    assert float(loss_fn(logits, labels, tf.ones(6))) == pytest.approx(float(loss_fn(logits, labels)), rel=1e-6)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert float(make_loss("auto", model)(logits, labels, w)) == pytest.approx(want, rel=1e-5)
    probs = tf.nn.softmax(logits)
    fn = make_loss("sparse_categorical_crossentropy")
    assert float(fn(probs, labels, w)) == pytest.approx(want, rel=1e-4)
