"""One asynchronous worker against real shard processes computes exactly sequential SGD."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import tensorflow as tf
from asyncps.worker.trainer import BatchStream, Telemetry, Trainer, make_grad_fn

from asyncps.delays import NoDelay, StepDelay
from asyncps.ml.datasets import Dataset, load_dataset
from asyncps.ml.models import build_model, loss_fn
from asyncps.placement import VariableSpec, place, split_for_shards
from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.transport import ModelClient, connect_model

STEPS = 25
LR = 0.1


@dataclass
class Setup:
    """One worker's trainer over two fresh shards holding the seeded MLP (hidden kernels sliced)."""

    data: Dataset
    x: np.ndarray
    y: np.ndarray
    model: keras.Model
    names: list[str]
    initial: dict[str, np.ndarray]
    client: ModelClient
    telemetry: Telemetry
    trainer: Trainer


def keras_sgd_steps(model: keras.Model, x: np.ndarray, y: np.ndarray, steps: int, lr: float) -> None:
    """`steps` of plain Keras SGD at `lr` in this process, training mode, on the same seeded batches a worker's
    BatchStream(x, y, 32, seed=5) gives: the reference a worker's run through the shards is held to."""
    optimizer = keras.optimizers.SGD(lr)
    batches = BatchStream(x, y, 32, seed=5)
    for _ in range(steps):
        bx, by = batches.next()
        with tf.GradientTape() as tape:
            loss = loss_fn(model(bx, training=True), by)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables,
                                      strict=True))


def one_worker(start_shards: Callable[[int], list[str]], pipeline: bool = False, policy: str = "none") -> Setup:
    addresses = start_shards(2)
    data = load_dataset("digits", 0)
    x, y = data.x_train[:600], data.y_train[:600]
    model = build_model("mlp", data.num_features, data.num_classes, seed=3)
    names = [v.path for v in model.trainable_variables]
    specs = [VariableSpec(v.path, tuple(v.shape), "float32") for v in model.trainable_variables]
    # a low threshold slices the hidden kernels over both shards, so reassembly is exercised too
    placement = place(specs, 2, slice_threshold_bytes=16 * 1024)
    assert any(p.sliced for p in placement.parts)
    initial = {v.path: np.array(v.numpy()) for v in model.trainable_variables}
    client = connect_model("worker-0", addresses, placement)
    rule = UpdateRuleConfig(OptimizerConfig("sgd", LR), staleness_policy=policy)
    for shard, values in enumerate(split_for_shards(placement, initial)):
        client.shards[shard].initialize("test", shard, 2, rule, values)
    telemetry = Telemetry()
    trainer = Trainer(client, names, make_grad_fn(model, loss_fn), BatchStream(x, y, 32, seed=5),
                      StepDelay(NoDelay()), telemetry, pipeline=pipeline)
    return Setup(data, x, y, model, names, initial, client, telemetry, trainer)


def test_one_worker_equals_sequential_sgd(start_shards: Callable[[int], list[str]]) -> None:
    setup = one_worker(start_shards)
    data, x, y, names, initial = setup.data, setup.x, setup.y, setup.names, setup.initial
    client, telemetry, trainer = setup.client, setup.telemetry, setup.trainer
    trainer.run(threading.Event(), max_steps=STEPS)
    pushes, steps = telemetry.drain()
    assert len(steps) == STEPS and len(pushes) == 2 * STEPS
    assert all(p.accepted and p.staleness == 0 for p in pushes)
    assert client.versions == [STEPS, STEPS]

    reference = build_model("mlp", data.num_features, data.num_classes, seed=3)
    keras_sgd_steps(reference, x, y, STEPS, LR)

    client.pull()
    for var in reference.trainable_variables:
        np.testing.assert_allclose(client.values[var.path], var.numpy(), rtol=1e-6, atol=1e-6,
                                   err_msg=var.path)
    moved = max(float(np.abs(client.values[n] - initial[n]).max()) for n in names)
    assert moved > 1e-3, "training did not move the parameters"
    client.close()


def test_a_pipelined_worker_computes_sgd_delayed_by_one_step_and_records_it(
    start_shards: Callable[[int], list[str]],
) -> None:
    """--pipeline: gradient k is computed from the values after step k-2 while step k-1 is in
    flight, so one worker runs SGD with a delay of one step: w[k+1] = w[k] - lr * g(w[k-1]),
    every push after the first is measured at staleness 1, and nothing is lost or doubled."""
    setup = one_worker(start_shards, pipeline=True)
    x, y, model, names, initial = setup.x, setup.y, setup.model, setup.names, setup.initial
    client, telemetry, trainer = setup.client, setup.telemetry, setup.trainer
    trainer.run(threading.Event(), max_steps=STEPS)
    pushes, steps = telemetry.drain()
    assert len(steps) == STEPS and len(pushes) == 2 * STEPS
    assert all(p.accepted for p in pushes)
    assert sorted(p.staleness for p in pushes) == [0, 0] + [1] * (2 * STEPS - 2)
    assert client.versions == [STEPS, STEPS]

    grad_fn = make_grad_fn(model, loss_fn)
    batches = BatchStream(x, y, 32, seed=5)
    current = [initial[n].copy() for n in names]
    previous = [v.copy() for v in current]
    for _ in range(STEPS):
        bx, by = batches.next()
        _, grads = grad_fn(previous, bx, by)
        previous = [v.copy() for v in current]
        current = [v - np.float32(LR) * np.asarray(g) for v, g in zip(current, grads, strict=True)]

    client.pull()
    for name, value in zip(names, current, strict=True):
        np.testing.assert_allclose(client.values[name], value, rtol=1e-5, atol=1e-5, err_msg=name)
    client.close()


def test_a_pipelined_worker_with_dc_asgd_is_corrected_against_the_values_of_its_base_version(
    start_shards: Callable[[int], list[str]],
) -> None:
    """--pipeline with DC-ASGD: gradient k is computed from w[k-1] and pushed with its version, so
    the shard corrects it against w[k-1], not against the values the worker read last (w[k], which
    would make the gap zero for one worker): w[k+1] = w[k] - lr * (g + lambda * g * g * (w[k] - w[k-1]))
    with g = g(w[k-1]), computed here in numpy."""
    lam = np.float32(50.0)  # large enough that the correction shows well above the tolerance
    setup = one_worker(start_shards, pipeline=True, policy=f"dc-asgd:lambda={float(lam)}")
    x, y, model, names, initial = setup.x, setup.y, setup.model, setup.names, setup.initial
    client, telemetry, trainer = setup.client, setup.telemetry, setup.trainer
    trainer.run(threading.Event(), max_steps=STEPS)
    pushes, _ = telemetry.drain()
    assert all(p.accepted for p in pushes) and client.versions == [STEPS, STEPS]

    grad_fn = make_grad_fn(model, loss_fn)
    batches = BatchStream(x, y, 32, seed=5)
    current = [initial[n].copy() for n in names]
    previous = [v.copy() for v in current]
    uncorrected = [v.copy() for v in current]  # delayed SGD: what a zero gap gives
    uncorrected_previous = [v.copy() for v in current]
    lr = np.float32(LR)
    for _ in range(STEPS):
        bx, by = batches.next()
        _, grads = grad_fn(previous, bx, by)
        _, plain = grad_fn(uncorrected_previous, bx, by)
        g = [np.asarray(v, dtype=np.float32) for v in grads]
        corrected = [gk + lam * gk * gk * (w - r) for gk, w, r in zip(g, current, previous, strict=True)]
        previous = [v.copy() for v in current]
        current = [w - lr * c for w, c in zip(current, corrected, strict=True)]
        uncorrected_previous = [v.copy() for v in uncorrected]
        uncorrected = [w - lr * np.asarray(p) for w, p in zip(uncorrected, plain, strict=True)]

    client.pull()
    for name, value in zip(names, current, strict=True):
        np.testing.assert_allclose(client.values[name], value, rtol=1e-5, atol=1e-5, err_msg=name)
    gap = max(float(np.abs(c - u).max()) for c, u in zip(current, uncorrected, strict=True))
    assert gap > 1e-3, f"the correction is too small to tell apart from none ({gap})"
    client.close()
