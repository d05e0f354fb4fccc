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
    x, y = kerasdata.read(source(), "x")
    np.testing.assert_array_equal(x, X)
    np.testing.assert_array_equal(y, Y)
    assert x.dtype == X.dtype and y.dtype == Y.dtype  # integers stay integers (ids above 2**24 exact)


def test_arrays_and_specs_are_not_sources() -> None:
    assert all(kerasdata.kind(s) is None for s in (X, [1, 2], (X, Y), None, {"a": X}))


@pytest.mark.parametrize(("source", "message"), [
    (tf.data.Dataset.from_tensor_slices((X, Y)).batch(8).repeat(), r"infinite tf.data.Dataset .*take\(batches\)"),
    (Batches(endless=True), "PyDataset without a length"),
    (tf.data.Dataset.from_tensor_slices((X, Y)), "not batched"),
    (tf.data.Dataset.from_tensor_slices((X, Y, np.ones(35))).batch(8), "sample weights"),
    (tf.data.Dataset.from_tensor_slices(({"a": X}, Y)).batch(8), "several inputs"),
    (tf.data.Dataset.from_tensor_slices(X).batch(8), r"not an \(x, y\) pair"),
    (iter([(X[:4], Y[:3])]), "4 inputs but 3 labels"),
    (iter([(X[:4], Y[:4]), (np.zeros((4, 3)), Y[:4])]), r"batch 1 of x has examples of shape \(3,\)"),
    (iter([]), "no batches"),
    (lambda: 7, "returned int"),
])
def test_a_source_that_cannot_be_read_is_refused_with_what_to_do(source: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kerasdata.read(source, "x")


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
