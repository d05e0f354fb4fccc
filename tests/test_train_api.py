"""asyncps.train with Keras habits: a model object and numpy arrays in, the trained model, the summary
and the evaluation history out.

End to end (real processes, marked slow): an in-memory functional model, compiled or not, trained on
one shard and on two; the model handed back is the caller's architecture with new weights, and its
accuracy on the validation arrays is the chief's final evaluation. Fast: the mistakes refused before
any process starts, and the `keras:PATH` model spec loaded as every process loads it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import asyncps
from asyncps.ml.datasets import load_digits
from asyncps.ml.specs import model_problem, spec_problems
from asyncps.rundir import EvalRow, RunConfigRecord, RunDir, read_rows


def digit_arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The 8x8 digits as images [n, 8, 8] (not flat) with int32 labels, split 80/20."""
    data, target = load_digits()
    x = (data.reshape(-1, 8, 8) / 16.0).astype(np.float32)
    y = target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = x[order], y[order]
    cut = int(len(y) * 0.8)
    return x[:cut], y[:cut], x[cut:], y[cut:]


def functional_model(compiled: bool) -> Any:
    """A small functional model over 8x8 images that outputs logits."""
    import keras

    inputs = keras.Input(shape=(8, 8), name="image")
    hidden = keras.layers.Dense(32, activation="relu", name="hidden")(keras.layers.Flatten(name="flat")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(10, name="scores")(hidden), name="digits_net")
    if compiled:
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    return model


def accuracy(model: Any, x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.argmax(model.predict(x, verbose=0), axis=1) == y))


@pytest.mark.slow
@pytest.mark.parametrize(("num_ps", "compiled"), [(1, True), (2, False)])
def test_in_memory_model_and_arrays(tmp_path: Path, num_ps: int, compiled: bool) -> None:
    import keras

    x, y, x_val, y_val = digit_arrays()
    model = functional_model(compiled)
    initial = [np.array(w) for w in model.get_weights()]
    result = asyncps.train(model=model, x=x, y=y, validation_data=(x_val, y_val), num_workers=2, num_ps=num_ps,
                           epochs=3, optimizer="adam", learning_rate=0.01, run_dir=tmp_path / "run")
    trained = result.model
    assert trained is model, "the model handed in is trained in place, as model.fit trains it"
    assert isinstance(trained, keras.Model) and trained.name == "digits_net"
    assert trained.input_shape == (None, 8, 8)  # the caller's model, not the flat-input wrapper
    assert any(not np.allclose(a, b) for a, b in zip(initial, trained.get_weights(), strict=True))
    assert result.summary.ps_shards == num_ps and result.final_eval is result.summary.final_eval
    assert result.summary.final_eval.accuracy > 0.8
    assert accuracy(trained, x_val, y_val) == pytest.approx(result.summary.final_eval.accuracy, abs=0.005)
    assert result.history and result.history[-1].accuracy == pytest.approx(result.summary.final_eval.accuracy,
                                                                           abs=1e-6)
    history = result.history.history  # as Keras' History.history: one entry per evaluation
    assert set(history) >= {"loss", "val_loss", "val_accuracy", "updates", "elapsed_s"}
    assert len(history["val_loss"]) == len(result.history) == len(history["loss"])
    assert history["val_accuracy"][-1] == result.history[-1].accuracy
    assert np.isfinite(history["loss"][-1]) and history["updates"] == sorted(history["updates"])
    assert bool(trained.compiled) == compiled  # compiled as the caller compiled it


# -- refused before any process starts -----------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"x": np.zeros((10, 4)), "y": np.zeros(9, dtype=int), "validation_split": 0.2}, "x has 10 examples but y has 9"),
    ({"dataset": "digits", "x": np.zeros((10, 4)), "y": np.zeros(10, dtype=int)}, "either dataset= or arrays"),
    ({"x": np.zeros((10, 4))}, "both x= and y="),
    ({"x": np.zeros((10, 4)), "y": np.zeros(10, dtype=int)}, "validation_data="),
    ({"verbose": 3}, "verbose is 0, 1, 2 or 'auto', not 3"),
    ({"verbose": 1, "progress": False}, "give verbose= or progress=, not both"),
    # float targets are fine, but the built-in model's default loss (crossentropy over class ids) is not for them
    ({"x": np.zeros((10, 4)), "y": np.zeros(10), "validation_split": 0.2}, "are not class ids"),
    ({"x": np.zeros((10, 4)), "y": np.zeros(10, dtype=int), "validation_data": (np.zeros((3, 5)),
                                                                                np.zeros(3, dtype=int))},
     "validation x"),
])
def test_bad_inputs_are_refused(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        asyncps.train(model="mlp", run_dir=tmp_path / "run", **kwargs)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("make", "settings"), [
    (lambda k: k.optimizers.SGD(0.05), {"optimizer": "sgd", "learning_rate": 0.05, "optimizer_params": {}}),
    (lambda k: k.optimizers.SGD(0.1, momentum=0.8), {"optimizer": "momentum", "learning_rate": 0.1,
                                                     "optimizer_params": {"momentum": 0.8}}),
    (lambda k: k.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
     {"optimizer": "nesterov", "learning_rate": 0.1, "optimizer_params": {"momentum": 0.9}}),
    (lambda k: k.optimizers.Adam(0.002, beta_2=0.99), {"optimizer": "adam", "learning_rate": 0.002, "optimizer_params":
                                                       {"beta_1": 0.9, "beta_2": 0.99, "epsilon": 1e-7}}),
    (lambda k: k.optimizers.Adagrad(0.05), {"optimizer": "adagrad", "learning_rate": 0.05, "optimizer_params":
                                            {"initial_accumulator_value": 0.1, "epsilon": 1e-7}}),
    (lambda k: k.optimizers.SGD(k.optimizers.schedules.ExponentialDecay(0.1, 100, 0.9, staircase=True)),
     {"optimizer": "sgd", "learning_rate": 0.1,
      "optimizer_params": {"decay_steps": 100.0, "decay_rate": 0.9, "staircase": 1.0}}),
    (lambda k: k.optimizers.SGD(0.1, clipnorm=1.5),
     {"optimizer": "sgd", "learning_rate": 0.1, "optimizer_params": {}, "clipnorm": 1.5}),
    (lambda k: k.optimizers.AdamW(0.001), {"optimizer": "adam", "learning_rate": 0.001, "optimizer_params":
                                           {"beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7, "weight_decay": 0.004}}),
    (lambda k: k.optimizers.SGD(0.1, momentum=0.9, weight_decay=0.01),
     {"optimizer": "momentum", "learning_rate": 0.1, "optimizer_params": {"momentum": 0.9, "weight_decay": 0.01}}),
    (lambda k: k.optimizers.Adagrad(0.1, clipvalue=0.5),
     {"optimizer": "adagrad", "learning_rate": 0.1, "clipvalue": 0.5,
      "optimizer_params": {"initial_accumulator_value": 0.1, "epsilon": 1e-7}}),
])
def test_a_compiled_optimizer_the_shards_implement_is_the_runs(make: Any, settings: dict[str, Any]) -> None:
    import keras

    from asyncps.config import RunConfig
    from asyncps.tools.api import compiled_optimizer

    model = functional_model(compiled=False)
    model.compile(optimizer=make(keras), loss="mse")
    assert compiled_optimizer(model) == settings
    RunConfig(**settings)  # settings the run takes (the shards validate the optimizer's parameters)
    assert compiled_optimizer(functional_model(compiled=False)) == {}


def _excluding_bias(optimizer: Any) -> Any:
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    return optimizer


@pytest.mark.parametrize(("make", "message"), [
    (lambda k: "rmsprop", "compiled with RMSprop, which the shards do not implement"),
    (lambda k: k.optimizers.Adam(0.1, amsgrad=True), "Adam with amsgrad=True"),
    (lambda k: _excluding_bias(k.optimizers.AdamW(0.001)), "AdamW with variables excluded from weight decay"),
    (lambda k: k.optimizers.SGD(k.optimizers.schedules.PiecewiseConstantDecay([10], [0.1, 0.01])),
     "a PiecewiseConstantDecay schedule"),
])
def test_a_compiled_optimizer_the_shards_do_not_implement_is_refused(tmp_path: Path, make: Any, message: str) -> None:
    import keras

    x, y, x_val, y_val = digit_arrays()
    model = functional_model(compiled=False)
    model.compile(optimizer=make(keras), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match=message):
        asyncps.train(model=model, x=x, y=y, validation_data=(x_val, y_val), run_dir=tmp_path / "run")


def test_keras_model_spec_is_checked() -> None:
    assert model_problem("keras:/some/where/m.keras") is None
    assert "keras:PATH.keras" in (model_problem("keras:/some/where/m.h5") or "")
    assert spec_problems("keras:m.keras", "digits") == []


def test_saved_model_builds_as_every_process_builds_it(tmp_path: Path) -> None:
    from asyncps.ml.models import build_model

    model = functional_model(compiled=False)
    path = tmp_path / "m.keras"
    model.save(path)
    first, second = (build_model(f"keras:{path}", 64, 10) for _ in range(2))
    paths = [v.path for v in first.trainable_variables]
    assert paths == [v.path for v in second.trainable_variables]
    assert first.input_shape == (None, 64)  # the flat features every role feeds
    for mine, built in zip(model.trainable_variables, first.trainable_variables, strict=True):
        np.testing.assert_array_equal(mine.numpy(), built.numpy())  # the saved weights are the start
    with pytest.raises(ValueError, match="do not hold the data's 63 features"):
        build_model(f"keras:{path}", 63, 10)


@pytest.mark.slow
def test_a_model_with_dropout_trains_as_model_fit_trains_it(tmp_path: Path) -> None:
    """Dropout's random generator is each worker's own (seeded per worker): the model is accepted, trained
    in place, and reaches a plain model.fit's held-out accuracy on the same data and epochs (within 1.5
    points, the issue's bar)."""
    import keras

    x, y, x_val, y_val = digit_arrays()

    def net() -> Any:
        inputs = keras.Input(shape=(8, 8))
        hidden = keras.layers.Dense(64, activation="relu")(keras.layers.Flatten()(inputs))
        hidden = keras.layers.Dropout(0.2)(hidden)
        return keras.Model(inputs, keras.layers.Dense(10)(hidden))

    # Adam at 0.003: at 0.01 the last steps' noise alone moved the async run's held-out accuracy by 1-4 points from
    # run to run (0.942-0.975 against fit's 0.981); at 0.003 six runs gave 0.975-0.983 against fit's 0.969
    keras.utils.set_random_seed(0)
    plain = net()
    plain.compile(optimizer=keras.optimizers.Adam(0.003),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    plain.fit(x, y, batch_size=32, epochs=10, verbose=0)
    fit_accuracy = accuracy(plain, x_val, y_val)
    keras.utils.set_random_seed(0)
    model = net()
    result = asyncps.train(model=model, x=x, y=y, validation_data=(x_val, y_val), num_workers=2, num_ps=1,
                           epochs=10, optimizer="adam", learning_rate=0.003, run_dir=tmp_path / "run")
    assert result.model is model
    ours = accuracy(model, x_val, y_val)
    assert ours >= fit_accuracy - 0.015, (ours, fit_accuracy)


@pytest.mark.slow
def test_early_stopping_ends_the_run_and_callbacks_see_each_evaluation(tmp_path: Path) -> None:
    """keras.callbacks.EarlyStopping becomes the chief's --early-stop rule: a run planned for 200 epochs ends
    when the validation loss stops improving; another callback sees every evaluation as an epoch's end."""
    import keras

    class Seen(keras.callbacks.Callback):  # type: ignore[misc]  # keras is untyped
        def __init__(self) -> None:
            super().__init__()
            self.logs: list[dict[str, float]] = []

        def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
            self.logs.append(dict(logs or {}))

    x, y, x_val, y_val = digit_arrays()
    seen = Seen()
    stop = keras.callbacks.EarlyStopping(monitor="val_loss", patience=2, min_delta=0.5)
    best = tmp_path / "best.keras"
    checkpoint = keras.callbacks.ModelCheckpoint(str(best), monitor="val_loss", save_best_only=True)
    result = asyncps.train(model=functional_model(False), x=x, y=y, validation_data=(x_val, y_val), num_workers=2,
                           num_ps=1, epochs=200, optimizer="adam", learning_rate=0.01, eval_every_s=0.5,
                           callbacks=[stop, seen, checkpoint], run_dir=tmp_path / "run")
    log = RunDir(tmp_path / "run").log("chief").read_text()
    assert "early stopping: loss did not improve by more than 0.5 for 2 evaluations" in log
    assert result.summary.epochs < 200 and result.summary.data["tasks_done"] < result.summary.data["tasks_planned"]
    assert len(seen.logs) == len(result.history) >= 3 and all("val_loss" in logs for logs in seen.logs)
    assert seen.model is not None
    # the ModelCheckpoint saved the weights of the evaluation with the lowest val_loss, and they load in Keras
    rows = read_rows(RunDir(tmp_path / "run").evals, EvalRow)
    judged = min(rows, key=lambda row: row.loss)
    saved = keras.models.load_model(best)
    assert accuracy(saved, x_val, y_val) == pytest.approx(judged.accuracy, abs=1e-6), (judged, rows)
    assert not list((tmp_path / "run" / "eval-weights").glob("*.npz"))  # each read once, then removed


def test_a_model_checkpoint_without_a_model_object_or_with_tables_read_by_rows_is_refused(tmp_path: Path) -> None:
    import keras

    checkpoint = keras.callbacks.ModelCheckpoint(str(tmp_path / "w.keras"))
    with pytest.raises(ValueError, match="ModelCheckpoint saves the model object it is given"):
        asyncps.train(model="mlp", callbacks=[checkpoint], run_dir=tmp_path / "run")
    inputs = keras.Input((4,), dtype="int64")
    x = keras.layers.Flatten()(keras.layers.Embedding(50, 3, name="ids")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2)(x))
    with pytest.raises(ValueError, match=r"tables of \['ids'\] are read by rows.*row_pull='off'"):
        asyncps.train(model=model, x=np.zeros((10, 4), np.int64), y=np.zeros(10, np.int64), validation_split=0.2,
                      callbacks=[checkpoint], run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("source", ["tf.data", "generator"])
def test_a_dataset_or_generator_trains_every_example_once_per_epoch(tmp_path: Path, source: str) -> None:
    """x= a tf.data.Dataset of batches, or a function returning a generator of them (validation_data the other
    kind): read to their end here, then trained as arrays; the chief's accounting counts each example once an
    epoch, and the model learns."""
    import tensorflow as tf

    x, y, x_val, y_val = digit_arrays()

    def batches(xs: np.ndarray, ys: np.ndarray) -> Any:
        return ((xs[i:i + 50], ys[i:i + 50]) for i in range(0, len(xs), 50))

    train_data: Any = (tf.data.Dataset.from_tensor_slices((x, y)).batch(50) if source == "tf.data"
                       else (lambda: batches(x, y)))
    val_data: Any = (batches(x_val, y_val) if source == "tf.data"
                     else tf.data.Dataset.from_tensor_slices((x_val, y_val)).batch(64))
    result = asyncps.train(model=functional_model(compiled=True), x=train_data, validation_data=val_data,
                           num_workers=2, num_ps=1, epochs=2, optimizer="adam", learning_rate=0.01,
                           run_dir=tmp_path / "run")
    data = result.summary.data
    assert data["examples_done"] == 2 * len(x) and data["tasks_done"] == data["tasks_planned"], data
    assert data["duplicate_completions"] == 0 and data["tasks_not_done"] == 0, data
    with np.load(RunDir(tmp_path / "run").input_data) as sent:  # the arrays the run trained on: the sources'
        np.testing.assert_array_equal(sent["x_train"], x)
        np.testing.assert_array_equal(sent["y_test"], y_val)
    assert result.summary.final_eval.accuracy > 0.8


@pytest.mark.slow
def test_class_weight_zero_leaves_a_class_unlearned(tmp_path: Path) -> None:
    """class_weight={0: 0}: digit 0's examples weigh nothing in the workers' loss, so the model almost never
    predicts 0 (unweighted, digit 0 is the easiest class: recall ~0.95+), while it learns the other nine."""
    x, y, x_val, y_val = digit_arrays()
    import keras

    model = functional_model(compiled=False)  # compiled with Adam: the shards run it (no optimizer= given)
    model.compile(optimizer=keras.optimizers.Adam(0.01, beta_1=0.85),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    result = asyncps.train(model=model, x=x, y=y, validation_data=(x_val, y_val), class_weight={0: 0.0},
                           num_workers=2, num_ps=1, epochs=3, run_dir=tmp_path / "run")
    run = RunConfigRecord.load(tmp_path / "run").run
    assert (run["optimizer"], run["learning_rate"], run["optimizer_params"]["beta_1"]) == ("adam", 0.01, 0.85), run
    predicted = np.argmax(result.model.predict(x_val, verbose=0), axis=1)
    zero = y_val == 0
    recall_zero = float(np.mean(predicted[zero] == 0))
    others = float(np.mean(predicted[~zero] == y_val[~zero]))
    print(f"class_weight {{0: 0}}: recall of digit 0 {recall_zero:.3f}, accuracy on the others {others:.3f}")
    assert recall_zero < 0.3 and others > 0.8, (recall_zero, others)
    with np.load(RunDir(tmp_path / "run").input_data) as sent:
        np.testing.assert_array_equal(sent["w_train"], np.where(y == 0, 0.0, 1.0).astype(np.float32))


def test_csvlogger_tensorboard_and_a_callback_of_ones_own_see_each_evaluation(tmp_path: Path) -> None:
    """The callbacks asyncps.train runs here, driven by eval.csv's rows as the chief appends them (no cluster:
    the rows are written by hand, as the chief writes them)."""
    import time

    import keras

    from asyncps.rundir.tables import RowWriter
    from asyncps.tools.api import EvaluationCallbacks

    files = RunDir(tmp_path / "run")
    files.root.mkdir()
    model = functional_model(compiled=True)
    ends: list[int] = []
    own = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: ends.append(epoch),
                                         on_train_end=lambda logs: ends.append(-1))
    callbacks = [keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
                 keras.callbacks.TensorBoard(str(tmp_path / "board")), own]
    sink = EvaluationCallbacks(callbacks, files, model, None)
    with RowWriter(files.evals, EvalRow) as rows:
        rows.write(EvalRow(time.time(), 1.0, 10, (10,), 0.5, 0.8))
        rows.flush()
        sink.show(None)
        rows.write(EvalRow(time.time(), 2.0, 20, (20,), 0.25, 0.9))
    sink.close()
    assert (tmp_path / "log.csv").read_text().splitlines() == [
        "epoch,updates,val_accuracy,val_loss", "0,10.0,0.8,0.5", "1,20.0,0.9,0.25"]
    assert list((tmp_path / "board" / "validation").glob("events.out.tfevents.*"))
    assert ends == [0, 1, -1]
    with pytest.raises(ValueError, match="TensorBoard logs the compiled optimizer's rate"):
        asyncps.train(model=functional_model(compiled=False), callbacks=[keras.callbacks.TensorBoard(str(tmp_path))],
                      run_dir=tmp_path / "other")


@pytest.mark.slow
def test_a_callback_that_sets_stop_training_ends_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """As in model.fit: a callback's `self.model.stop_training = True` ends a run planned for 200 epochs (the
    caller writes the run directory's stop request, the chief honours it), and the summary says why; with
    verbose=0 nothing is printed."""
    import keras

    class StopAtSecond(keras.callbacks.Callback):  # type: ignore[misc]  # keras is untyped
        def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
            if epoch == 1:
                self.model.stop_training = True

    x, y, x_val, y_val = digit_arrays()
    result = asyncps.train(model=functional_model(False), x=x, y=y, validation_data=(x_val, y_val), num_workers=2,
                           num_ps=1, epochs=200, optimizer="adam", learning_rate=0.01, eval_every_s=0.5,
                           callbacks=[StopAtSecond()], run_dir=tmp_path / "run", verbose=0)
    assert capsys.readouterr().out == ""
    assert result.summary.stop_reason == "stop requested: a callback set model.stop_training at evaluation 1"
    assert result.summary.epochs < 200
    assert not RunDir(tmp_path / "run").stop_request.exists()  # consumed


def test_verbose_2_prints_one_line_per_evaluation() -> None:
    """Keras' verbose=2 (a line per epoch): a line for each new evaluation the chief's status carries."""
    import io

    from asyncps.pb import coordinator_pb2 as cpb
    from asyncps.tools.progress import EvalLineDisplay

    out = io.StringIO()
    display = EvalLineDisplay(out)
    for updates, version in [(5, 0), (10, 8), (12, 8), (20, 19), (25, 19)]:
        display.show(cpb.ClusterStatus(updates=updates, eval_version=version, eval_accuracy=0.5))
    display.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "updates     10" in lines[0] and "@ 19" in lines[1], lines
