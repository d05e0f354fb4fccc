"""Models with several inputs (issue 35 item 2): x as a list or a dict of arrays, packed into one array of
features (asyncps.ml.multiio) that a wrapper slices back into the model's inputs (asyncps.ml.models.InputSlice)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras

import asyncps
from asyncps.ml.models import build_model
from asyncps.ml.multiio import InputSpec, input_specs, pack
from asyncps.rundir import RunDir

IDS = 40  # the synthetic data's id space
FEATURES = 8
CLASSES = 4


def two_inputs(seed: int = 0) -> Any:
    """Wide-and-deep shaped: an id through an Embedding beside dense features, one softmax-free head."""
    ids = keras.Input(shape=(1,), dtype="int32", name="user_id")
    dense = keras.Input(shape=(FEATURES,), name="features")
    embedded = keras.layers.Flatten()(keras.layers.Embedding(IDS, 8, name="user_table")(ids))
    hidden = keras.layers.Concatenate()([embedded, dense])
    hidden = keras.layers.Dense(32, activation="relu", name="hidden")(hidden)
    return keras.Model([ids, dense], keras.layers.Dense(CLASSES, name="logits")(hidden))


def synthetic(n: int, seed: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Offline data where both inputs matter: the class is the argmax of a per-id bias plus a linear map of the
    features (the same bias and map for every call; `seed` draws the examples)."""
    table = np.random.default_rng(1234)
    bias, mix = table.normal(0, 1.5, (IDS, CLASSES)), table.normal(0, 1, (FEATURES, CLASSES))
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, IDS, n)
    features = rng.normal(0, 1, (n, FEATURES)).astype(np.float32)
    labels = np.argmax(bias[ids] + features @ mix, axis=1).astype(np.int64)
    return {"user_id": ids.astype(np.int32), "features": features}, labels


def test_pack_orders_a_dict_by_the_inputs_and_a_list_as_given() -> None:
    specs = [InputSpec("user_id", (1,), "int32"), InputSpec("features", (2,), "float32")]
    ids, features = np.array([3, 5]), np.array([[0.5, 1.5], [2.5, 3.5]], np.float32)
    by_name = pack({"features": features, "user_id": ids}, specs)
    assert by_name.dtype == np.float32
    np.testing.assert_array_equal(by_name, [[3, 0.5, 1.5], [5, 2.5, 3.5]])
    np.testing.assert_array_equal(pack([ids[:, None], features], specs), by_name)
    only_ids = pack([ids, ids], [InputSpec("a", (1,), "int64"), InputSpec("b", (1,), "int32")])
    assert only_ids.dtype == np.int64  # every input integer: ids stay exact at any size


@pytest.mark.parametrize(("x", "message"), [
    ({"user_id": np.zeros(2)}, r"keyed by \['user_id'\], but the model's are \['user_id', 'features'\] "
                               r"\(missing \['features'\]\)"),
    ({"user_id": np.zeros(2), "features": np.zeros((2, 2)), "age": np.zeros(2)}, r"unknown \['age'\]"),
    ([np.zeros(2)], r"has 1 arrays, but the model has 2"),
    ([np.zeros(2), np.zeros((3, 2))], r"different numbers of examples \{'user_id': 2, 'features': 3\}"),
    ([np.zeros(2), np.zeros((2, 3))], r"x\['features'\] has examples of shape \(3,\), but the model takes"),
    ([np.array([2**25, 0]), np.zeros((2, 2))], r"integers beyond 2\*\*24"),
])
def test_pack_says_what_does_not_fit_the_model(x: Any, message: str) -> None:
    specs = [InputSpec("user_id", (1,), "int32"), InputSpec("features", (2,), "float32")]
    with pytest.raises(ValueError, match=message):
        pack(x, specs)


def test_the_wrapper_slices_the_packed_features_back_into_the_inputs(tmp_path: Path) -> None:
    keras.utils.set_random_seed(0)
    model = two_inputs()
    x, _ = synthetic(6, 0)
    model.save(tmp_path / "m.keras")
    specs = input_specs(model)
    assert [s.name for s in specs] == ["user_id", "features"]
    packed = pack(x, specs)
    wrapper = build_model(f"keras:{tmp_path / 'm.keras'}", packed.shape[1], CLASSES)
    np.testing.assert_allclose(wrapper(packed), model([x["user_id"][:, None], x["features"]]), rtol=1e-5)
    wrapper.save(tmp_path / "w.keras")  # the chief exports the wrapper: it loads back
    np.testing.assert_allclose(keras.saving.load_model(tmp_path / "w.keras")(packed), wrapper(packed), rtol=1e-5)
    with pytest.raises(ValueError, match=r"9 values per example packed, but the data has 5 features"):
        build_model(f"keras:{tmp_path / 'm.keras'}", 5, CLASSES)


def test_asyncps_train_refuses_inputs_that_do_not_fit_before_any_process_starts(tmp_path: Path) -> None:
    x, y = synthetic(20, 0)
    model = two_inputs()
    with pytest.raises(ValueError, match=r"asyncps.train: x is keyed by \['features', 'user'\]"):
        asyncps.train(model=model, x={"user": x["user_id"], "features": x["features"]}, y=y, validation_split=0.2,
                      run_dir=tmp_path / "a")
    with pytest.raises(ValueError, match=r"validation x has 1 arrays, but the model has 2"):
        asyncps.train(model=model, x=x, y=y, validation_data=([x["features"]], y), run_dir=tmp_path / "b")
    with pytest.raises(ValueError, match=r"the model has 2 inputs: give x as a list of arrays"):
        asyncps.train(model=model, x=x["features"], y=y, validation_split=0.2, run_dir=tmp_path / "c")
    with pytest.raises(ValueError, match=r"x or y of several arrays \(a list or dict\) needs a model of several "
                                         r"inputs or outputs: a keras.Model object or a builder, not 'mlp'"):
        asyncps.train(model="mlp", x=x, y=y, validation_split=0.2, run_dir=tmp_path / "d")
    # a builder (here a lambda) is built here to learn the inputs
    with pytest.raises(ValueError, match=r"asyncps.train: x is keyed by \['features', 'ids'\]"):
        asyncps.train(model=lambda: two_inputs(), x={"ids": x["user_id"], "features": x["features"]}, y=y,
                      validation_split=0.2, run_dir=tmp_path / "e")
    assert not any((tmp_path / name).exists() for name in "abcde")


@pytest.mark.slow
def test_a_two_input_model_trains_on_two_shards_as_model_fit_trains_it(tmp_path: Path) -> None:
    """2 shards, 2 workers, x as a dict: held-out accuracy within 1.5 points of a plain model.fit on the same
    data and epochs; the model handed in is trained in place."""
    x, y = synthetic(3000, 1)
    x_val, y_val = synthetic(1000, 2)
    epochs = 10
    keras.utils.set_random_seed(0)
    plain = two_inputs()
    plain.compile(optimizer=keras.optimizers.Adam(0.003),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    plain.fit(x, y, batch_size=32, epochs=epochs, verbose=0)
    fit_accuracy = plain.evaluate(x_val, y_val, verbose=0)[1]
    keras.utils.set_random_seed(0)
    model = two_inputs()
    started = time.monotonic()
    result = asyncps.train(model=model, x=x, y=y, validation_data=(x_val, y_val), num_workers=2, num_ps=2,
                           epochs=epochs, optimizer="adam", learning_rate=0.003, run_dir=tmp_path / "run")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    ours = model.evaluate(x_val, y_val, verbose=0)[1]
    print(f"model.fit held-out accuracy {fit_accuracy:.4f}; asyncps.train (2 shards, 2 workers) {ours:.4f} "
          f"in {time.monotonic() - started:.0f}s")
    assert result.model is model
    assert ours >= fit_accuracy - 0.015, (ours, fit_accuracy)
    # the id table behind the packed features was read by rows (the ids sliced out of them on each batch)
    assert result.summary.row_staleness is not None and result.summary.row_staleness.rows > 0
    # the chief evaluated the packed features through the wrapper: the same accuracy as the model's own
    assert ours == pytest.approx(result.summary.final_eval.accuracy, abs=0.005)


def test_a_builder_of_several_inputs_reads_the_packed_features_of_a_dataset_spec(tmp_path: Path) -> None:
    """`--model package.module:function` with an `npz:` file of packed features: what workers and the chief build."""
    from asyncps.ml.datasets import load_dataset

    x, y = synthetic(30, 0)
    x_val, y_val = synthetic(10, 1)
    specs = input_specs(two_inputs())
    np.savez(tmp_path / "d.npz", x_train=pack(x, specs), y_train=y, x_test=pack(x_val, specs), y_test=y_val)
    data = load_dataset(f"npz:{tmp_path / 'd.npz'}", 0)
    assert data.x_train.dtype == np.float32 and data.x_train.shape == (30, 1 + FEATURES)
    keras.utils.set_random_seed(0)
    wrapper = build_model("tests.test_multi_input:two_inputs", data.num_features, CLASSES)
    keras.utils.set_random_seed(0)
    model = two_inputs()
    model.set_weights(wrapper.get_weights())
    np.testing.assert_allclose(wrapper(data.x_test), model([x_val["user_id"][:, None], x_val["features"]]),
                               rtol=1e-5)


@pytest.mark.slow
def test_a_builder_of_two_inputs_trains_by_name_from_a_dict_of_arrays(tmp_path: Path) -> None:
    """`model=package.module:function`: called here to learn its inputs (the dict packed in their order), by name
    in every process; the chief's evaluation and the exported model (which takes the packed features) agree."""
    x, y = synthetic(3000, 1)
    x_val, y_val = synthetic(1000, 2)
    started = time.monotonic()
    result = asyncps.train(model="tests.test_multi_input:two_inputs", x=x, y=y, validation_data=(x_val, y_val),
                           num_workers=2, num_ps=1, epochs=6, optimizer="adam", learning_rate=0.003,
                           run_dir=tmp_path / "run", user_path=[str(Path(__file__).resolve().parent.parent)])
    packed = pack(x_val, input_specs(two_inputs()))
    exported = float(np.mean(np.argmax(result.model.predict(packed, verbose=0), axis=1) == y_val))
    print(f"a builder by name: held-out accuracy {exported:.4f} in {time.monotonic() - started:.0f}s")
    assert result.summary.model == "tests.test_multi_input:two_inputs"
    assert exported >= 0.9
    assert exported == pytest.approx(result.summary.final_eval.accuracy, abs=0.005)


@pytest.mark.slow
def test_a_tf_data_dataset_of_two_inputs_trains_and_counts_each_example_once(tmp_path: Path) -> None:
    """Batches of a dict of inputs from tf.data (as model.fit reads them): read in the caller, joined by input
    name, packed like arrays; every example trained once per epoch, and the model learns (chance: 1/4)."""
    import tensorflow as tf

    x, y = synthetic(1200, 1)
    x_val, y_val = synthetic(400, 2)
    keras.utils.set_random_seed(0)
    result = asyncps.train(model=two_inputs(), x=tf.data.Dataset.from_tensor_slices((x, y)).batch(64),
                           validation_data=(x_val, y_val), num_workers=2, num_ps=1, epochs=2, optimizer="adam",
                           learning_rate=0.003, run_dir=tmp_path / "run")
    data = json.loads(RunDir(tmp_path / "run").summary.read_text())["data"]
    print(f"tf.data of two inputs: {data['examples_done']} examples done of 1200 x 2 epochs, "
          f"accuracy {result.summary.final_eval.accuracy:.3f}")
    assert data["examples_done"] == 2 * 1200 and data["tasks_done"] == data["tasks_planned"], data
    assert data["duplicate_completions"] == 0 and data["tasks_not_done"] == 0, data
    assert result.summary.final_eval.accuracy > 0.6
