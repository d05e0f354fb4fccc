"""asyncps.train's parameter-server input habits (asyncps.tools.datainput): a `dataset_fn(context)` called once per
worker and read into one training set (each worker's examples once), `steps_per_epoch` bounding endless sources,
and each mistake refused before any process starts. End to end (slow): a dataset_fn run and an endless generator
run through asyncps.train, each example accounted once an epoch, and the model learns; zero weights in a
dataset_fn's batches leave their class unlearned (the workers' loss is weighted)."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import asyncps
from asyncps.rundir import RunDir
from asyncps.tools import datainput
from asyncps.tools.api import _weights
from asyncps.tools.datainput import InputContext
from tests.test_train_api import digit_arrays, functional_model

X = np.arange(70, dtype=np.float32).reshape(35, 2)
Y = (np.arange(35) % 3).astype(np.int64)


def sharded(context: InputContext) -> Any:
    """TF's habit: the worker's shard of one dataset, batched by its share of a global batch of 8."""
    data = tf.data.Dataset.from_tensor_slices((X, Y)).shard(context.num_input_pipelines, context.input_pipeline_id)
    return data.batch(context.get_per_replica_batch_size(8))


class Endless(keras.utils.PyDataset):  # type: ignore[misc]  # keras is untyped
    """Batches of 4 of X, Y round and round: a PyDataset without a length."""

    @property
    def num_batches(self) -> int | None:
        return None

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        start = 4 * i % 32
        return X[start:start + 4], Y[start:start + 4]


def endless_generator() -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for i in itertools.count():
        start = 4 * i % 32
        yield X[start:start + 4], Y[start:start + 4]


def test_the_context_speaks_both_asyncps_and_tf() -> None:
    context = InputContext(worker_index=1, num_workers=4)
    assert (context.input_pipeline_id, context.num_input_pipelines, context.num_replicas_in_sync) == (1, 4, 4)
    assert context.get_per_replica_batch_size(64) == 16
    with pytest.raises(ValueError, match="not divisible"):
        context.get_per_replica_batch_size(10)


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_each_workers_shard_is_read_once_and_joined_in_worker_order(workers: int) -> None:
    x, y, w = datainput.from_dataset_fn(sharded, workers, None)
    assert w is None and len(x) == len(X)
    order = np.concatenate([np.arange(35)[i::workers] for i in range(workers)])
    np.testing.assert_array_equal(x, X[order])  # every example once: shard 0's, then shard 1's, ...
    np.testing.assert_array_equal(y, Y[order])


def test_a_dataset_fn_of_no_argument_is_called_per_worker_too() -> None:
    calls: list[int] = []

    def whole() -> Any:
        calls.append(1)
        return tf.data.Dataset.from_tensor_slices((X, Y)).batch(8)

    x, _, _ = datainput.from_dataset_fn(whole, 2, None)
    assert len(calls) == 2 and len(x) == 2 * len(X)


def test_a_dataset_fn_spec_is_imported_from_the_user_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`package.module:function`, as the other specs, imported here with `user_path=` in place."""
    monkeypatch.setattr(sys, "path", [*sys.path])  # train puts user_path on it: undone after the test
    (tmp_path / "mydata_fn.py").write_text(
        "import tensorflow as tf\n"
        "def shards(context):\n"
        "    x = tf.range(10, dtype=tf.float32)[:, None]\n"
        "    data = tf.data.Dataset.from_tensor_slices((x, tf.range(10) % 2))\n"
        "    return data.shard(context.num_workers, context.worker_index).batch(2)\n")
    with pytest.raises(ValueError, match="cannot import 'mydata_fn'"):
        datainput.from_dataset_fn("mydata_fn:shards", 2, None)
    with pytest.raises(ValueError, match="either dataset= or arrays"):
        # the spec imports (user_path=), its examples are read: a dataset= beside them is what is refused
        asyncps.train(model="mlp", dataset="digits", dataset_fn="mydata_fn:shards", validation_split=0.2,
                      user_path=[str(tmp_path)], run_dir=tmp_path / "run")
    x, _, _ = datainput.from_dataset_fn("mydata_fn:shards", 2, None)
    np.testing.assert_array_equal(x[:, 0], [0, 2, 4, 6, 8, 1, 3, 5, 7, 9])
    sys.modules.pop("mydata_fn", None)


def test_steps_per_epoch_is_the_batches_read_in_all_shared_by_the_workers() -> None:
    def endless(context: InputContext) -> Any:
        return tf.data.Dataset.from_tensor_slices((X, Y)).batch(4).repeat()

    x, _, _ = datainput.from_dataset_fn(endless, 2, 5)  # worker 0: 3 batches, worker 1: 2
    assert len(x) == 5 * 4
    np.testing.assert_array_equal(x, np.concatenate([X[:12], X[:8]]))
    assert len(datainput.from_dataset_fn(endless, 3, 2)[0]) == 2 * 4  # the third worker's dataset is not read


@pytest.mark.parametrize("source", [
    pytest.param(lambda: tf.data.Dataset.from_tensor_slices((X, Y)).batch(4).repeat(), id="tf.data"),
    pytest.param(Endless, id="PyDataset"),
    pytest.param(lambda: endless_generator(), id="generator"),
    pytest.param(lambda: endless_generator, id="generator-function"),
])
def test_steps_per_epoch_bounds_an_endless_source_given_as_x(source: Any) -> None:
    x, y, weights = datainput.read_inputs(source(), None, None, None, 3, 2)
    assert weights is None
    np.testing.assert_array_equal(x, X[:12])
    np.testing.assert_array_equal(y, Y[:12])


def test_batches_weights_come_through_a_dataset_fn() -> None:
    def weighted(context: InputContext) -> Any:
        part = slice(context.worker_index * 20, (context.worker_index + 1) * 20)
        return tf.data.Dataset.from_tensor_slices((X[part], Y[part], np.full(len(X[part]), 0.5))).batch(8)

    x, y, w = datainput.read_inputs(None, None, None, weighted, None, 2)
    np.testing.assert_array_equal(x, X)
    assert w is not None and w.dtype == np.float32 and np.all(w == 0.5)
    # class_weight multiplies them, as model.fit's does: class 0 weighs nothing in the workers' loss
    both = _weights(w, {0: 0.0}, y, None)
    assert both is not None
    np.testing.assert_array_equal(both, np.where(Y == 0, 0.0, 0.5).astype(np.float32))
    with pytest.raises(ValueError, match="do not give sample_weight= as well"):
        datainput.read_inputs(None, None, np.ones(35), weighted, None, 2)


def endless_fn(context: InputContext) -> Any:
    return tf.data.Dataset.from_tensor_slices((X, Y)).batch(4).repeat()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"dataset_fn": endless_fn}, r"worker 0 is an infinite tf.data.Dataset .*give steps_per_epoch="),
    ({"x": Endless()}, r"x is a PyDataset without a length.*steps_per_epoch="),
    ({"x": tf.data.Dataset.from_tensor_slices((X, Y)).batch(4).repeat()}, r"x is an infinite tf.data.Dataset"),
    ({"dataset_fn": lambda c: 7}, r"worker 0 is int, not a tf.data.Dataset"),
    ({"dataset_fn": lambda c: (X, Y)}, r"worker 0 is tuple, not a tf.data.Dataset"),
    ({"dataset_fn": tf.data.Dataset.from_tensor_slices((X, Y)).batch(4)}, "dataset_fn must be a function"),
    ({"dataset_fn": sharded, "x": X}, "do not give x= or y= as well"),
    ({"x": X, "y": Y, "steps_per_epoch": 3}, "arrays are trained whole every epoch"),
    ({"x": endless_generator(), "y": Y, "steps_per_epoch": 3}, "do not give y= as well"),
    ({"dataset_fn": sharded, "steps_per_epoch": 0}, "steps_per_epoch must be a positive integer"),
    ({"dataset_fn": sharded, "num_workers": 0}, "num_workers must be a positive integer"),
    ({"dataset_fn": sharded, "num_workers": "two"}, "num_workers must be a positive integer"),
    ({"dataset_fn": sharded, "steps_per_epoch": 2.5}, "steps_per_epoch must be a positive integer"),
    ({"dataset_fn": lambda c: tf.data.Dataset.from_tensor_slices((X[:, :1 + c.worker_index], Y)).batch(4)},
     r"worker 1's examples are \(2,\)"),
])
def test_a_bad_input_is_refused_before_any_process(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        asyncps.train(model="mlp", **{"validation_data": (X, Y), "num_workers": 2, "run_dir": tmp_path / "run",
                                      **kwargs})
    assert not (tmp_path / "run").exists()


def test_dataset_fn_beside_a_dataset_spec_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="either dataset= or arrays"):
        asyncps.train(model="mlp", dataset="digits", dataset_fn=sharded, validation_split=0.2,
                      run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def digit_shards(weigh_zero: float = 1.0) -> Any:
    """A dataset_fn over the digits' training split: each worker's shard in batches of 25 (of a global 50), the
    examples of digit 0 weighted `weigh_zero` (the others 1)."""
    x, y, _, _ = digit_arrays()

    def dataset_fn(context: InputContext) -> Any:
        weights = np.where(y == 0, weigh_zero, 1.0).astype(np.float32)
        data = tf.data.Dataset.from_tensor_slices((x, y, weights) if weigh_zero != 1.0 else (x, y))
        return data.shard(context.num_workers, context.worker_index).batch(context.get_per_replica_batch_size(50))

    return dataset_fn


def assert_each_example_once(data: dict[str, Any], examples: int) -> None:
    assert data["examples_done"] == examples and data["tasks_done"] == data["tasks_planned"], data
    assert data["duplicate_completions"] == 0 and data["tasks_not_done"] == 0, data


@pytest.mark.slow
def test_a_dataset_fn_trains_every_workers_examples_once_per_epoch(tmp_path: Path) -> None:
    x, y, x_val, y_val = digit_arrays()
    result = asyncps.train(model=functional_model(compiled=True), dataset_fn=digit_shards(),
                           validation_data=(x_val, y_val), num_workers=2, num_ps=2, epochs=2, optimizer="adam",
                           learning_rate=0.01, run_dir=tmp_path / "run")
    data = result.summary.data
    print(f"dataset_fn: {data['examples_done']} examples done of {len(x)} x 2 epochs, "
          f"accuracy {result.summary.final_eval.accuracy:.3f}")
    assert_each_example_once(data, 2 * len(x))
    with np.load(RunDir(tmp_path / "run").input_data) as sent:  # worker 0's shard, then worker 1's
        np.testing.assert_array_equal(sent["y_train"], np.concatenate([y[0::2], y[1::2]]))
    assert result.summary.final_eval.accuracy > 0.8  # chance: 0.1


@pytest.mark.slow
def test_an_endless_generator_trains_its_steps_per_epoch_batches_once_per_epoch(tmp_path: Path) -> None:
    x, y, x_val, y_val = digit_arrays()

    def endless() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for i in itertools.count():
            start = 50 * i % (len(x) - 50)
            yield x[start:start + 50], y[start:start + 50]

    result = asyncps.train(model=functional_model(compiled=True), x=endless, steps_per_epoch=20,
                           validation_data=(x_val, y_val), num_workers=2, num_ps=1, epochs=3, optimizer="adam",
                           learning_rate=0.01, run_dir=tmp_path / "run")
    data = result.summary.data
    print(f"generator: {data['examples_done']} examples done of 20 x 50 x 3 epochs, "
          f"accuracy {result.summary.final_eval.accuracy:.3f}")
    assert_each_example_once(data, 3 * 20 * 50)
    assert result.summary.final_eval.accuracy > 0.8


@pytest.mark.slow
def test_zero_weights_in_a_dataset_fns_batches_leave_their_class_unlearned(tmp_path: Path) -> None:
    """Batches of (x, y, sample_weight), digit 0 weighted 0: the workers' loss ignores those examples, so the model
    almost never predicts 0 (unweighted, digit 0 is the easiest class) while it learns the other nine."""
    x, _, x_val, y_val = digit_arrays()
    result = asyncps.train(model=functional_model(compiled=True), dataset_fn=digit_shards(weigh_zero=0.0),
                           validation_data=(x_val, y_val), num_workers=2, num_ps=1, epochs=3, optimizer="adam",
                           learning_rate=0.01, run_dir=tmp_path / "run")
    predicted = np.argmax(result.model.predict(x_val, verbose=0), axis=1)
    zero = y_val == 0
    recall_zero, others = float(np.mean(predicted[zero] == 0)), float(np.mean(predicted[~zero] == y_val[~zero]))
    print(f"dataset_fn weights 0 for digit 0: recall of 0 {recall_zero:.3f}, accuracy on the others {others:.3f}")
    assert recall_zero < 0.3 and others > 0.8, (recall_zero, others)
    assert_each_example_once(result.summary.data, 3 * len(x))  # weighted 0, still trained (and counted) once
