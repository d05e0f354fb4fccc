"""BatchNormalization's moving statistics on the shards (issue 35 item 1): a worker reads them with its pull,
steps in training mode and pushes each one's delta, which the shard adds (UpdateRuleConfig.state). Real
shard processes and real TensorFlow."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
from asyncps.worker.trainer import BatchStream, Telemetry, Trainer, make_grad_fn

import asyncps
from asyncps.delays import NoDelay, StepDelay
from asyncps.ml.datasets import load_dataset
from asyncps.ml.models import loss_fn, shard_variables, state_variables
from asyncps.placement import VariableSpec, place, split_for_shards
from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.transport import connect_model
from tests.test_train_api import accuracy, digit_arrays
from tests.test_worker_equivalence import keras_sgd_steps

STEPS = 20
LR = 0.1


def bn_mlp(num_features: int, num_classes: int) -> keras.Model:
    keras.utils.set_random_seed(3)
    inputs = keras.Input(shape=(num_features,))
    hidden = keras.layers.Dense(16, name="hidden")(inputs)
    hidden = keras.layers.BatchNormalization(momentum=0.8, name="bn")(hidden)
    hidden = keras.layers.Activation("relu")(hidden)
    return keras.Model(inputs, keras.layers.Dense(num_classes, name="scores")(hidden))


def test_one_worker_moves_the_statistics_as_local_keras_training(start_shards: Callable[[int], list[str]]) -> None:
    addresses = start_shards(2)
    data = load_dataset("digits", 0)
    x, y = data.x_train[:600], data.y_train[:600]
    model = bn_mlp(data.num_features, data.num_classes)
    state = state_variables(model)
    assert sorted(v.path.split("/")[-1] for v in state) == ["moving_mean", "moving_variance"]
    held = shard_variables(model)
    names = [v.path for v in held]
    placement = place([VariableSpec(v.path, tuple(v.shape), "float32") for v in held], 2)
    initial = {v.path: np.array(v.numpy()) for v in held}
    client = connect_model("worker-0", addresses, placement)
    rule = UpdateRuleConfig(OptimizerConfig("sgd", LR), state=tuple(v.path for v in state))
    for shard, values in enumerate(split_for_shards(placement, initial)):
        client.shards[shard].initialize("test", shard, 2, rule, values)
    telemetry = Telemetry()
    trainer = Trainer(client, names, make_grad_fn(model, loss_fn), BatchStream(x, y, 32, seed=5),
                      StepDelay(NoDelay()), telemetry)
    trainer.run(threading.Event(), max_steps=STEPS)
    pushes, _ = telemetry.drain()
    assert len(pushes) == 2 * STEPS and all(p.accepted for p in pushes)
    client.pull()
    # the worker's own model never took the statistics: they live on the shards
    for v in state:
        np.testing.assert_array_equal(v.numpy(), initial[v.path])

    reference = bn_mlp(data.num_features, data.num_classes)
    keras_sgd_steps(reference, x, y, STEPS, LR)
    moved = 0.0
    for v in shard_variables(reference):
        np.testing.assert_allclose(client.values[v.path], v.numpy(), rtol=1e-4, atol=1e-5, err_msg=v.path)
        moved = max(moved, float(np.max(np.abs(v.numpy() - initial[v.path]))))
    assert moved > 0.1
    client.close()


@pytest.mark.slow
def test_a_batchnorm_cnn_trains_on_two_shards_as_model_fit_trains_it(tmp_path: Path) -> None:
    """2 shards, 2 workers: held-out accuracy within 1.5 points of a plain model.fit on the same data and
    epochs; the model handed in is updated in place, moving statistics included (its evaluate agrees)."""
    x, y, x_val, y_val = digit_arrays()
    epochs = 10

    def net() -> Any:
        inputs = keras.Input(shape=(8, 8))
        hidden = keras.layers.Reshape((8, 8, 1))(inputs)
        hidden = keras.layers.Conv2D(8, 3, use_bias=False)(hidden)
        hidden = keras.layers.BatchNormalization()(hidden)
        hidden = keras.layers.Activation("relu")(hidden)
        hidden = keras.layers.Flatten()(hidden)
        hidden = keras.layers.Dense(32, use_bias=False)(hidden)
        hidden = keras.layers.BatchNormalization()(hidden)
        hidden = keras.layers.Activation("relu")(hidden)
        return keras.Model(inputs, keras.layers.Dense(10)(hidden))

    # Adam at 0.003, as tests/test_train_api.py's Dropout test (at 0.01 an async run's last steps move its held-out
    # accuracy by points from run to run)
    keras.utils.set_random_seed(0)
    plain = net()
    plain.compile(optimizer=keras.optimizers.Adam(0.003),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    plain.fit(x, y, batch_size=32, epochs=epochs, verbose=0)
    fit_accuracy = accuracy(plain, x_val, y_val)
    keras.utils.set_random_seed(0)
    model = net()
    before = [np.array(v.numpy()) for v in state_variables(model)]
    started = time.monotonic()
    result = asyncps.train(model=model, x=x, y=y, validation_data=(x_val, y_val), num_workers=2, num_ps=2,
                           epochs=epochs, optimizer="adam", learning_rate=0.003, run_dir=tmp_path / "run")
    ours = accuracy(model, x_val, y_val)
    print(f"model.fit held-out accuracy {fit_accuracy:.4f}; asyncps.train (2 shards, 2 workers) {ours:.4f} "
          f"in {time.monotonic() - started:.0f}s")
    assert result.model is model
    assert all(not np.allclose(b, v.numpy()) for b, v in zip(before, state_variables(model), strict=True)), \
        "the moving statistics came back with the model"
    assert ours >= fit_accuracy - 0.015, (ours, fit_accuracy)
    # inference mode uses the moving statistics: the chief's final evaluation and the model's agree
    assert ours == pytest.approx(result.summary.final_eval.accuracy, abs=0.005)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    assert model.evaluate(x_val, y_val, verbose=0)[1] == pytest.approx(ours, abs=1e-6)


@pytest.mark.slow
def test_local_sgd_with_state_on_the_shards_is_refused_with_why(tmp_path: Path) -> None:
    x, y, x_val, y_val = digit_arrays()
    inputs = keras.Input(shape=(8, 8))
    hidden = keras.layers.BatchNormalization()(keras.layers.Flatten()(inputs))
    model = keras.Model(inputs, keras.layers.Dense(10)(hidden))
    with pytest.raises(asyncps.TrainingFailed, match="local_steps"):
        asyncps.train(model=model, x=x, y=y, validation_data=(x_val, y_val), num_workers=1, num_ps=1, epochs=1,
                      local_steps=2, run_dir=tmp_path / "run")
