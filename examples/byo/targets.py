"""Tasks that are not single-label classification, for `--model`/`--dataset package.module:function`.

`regression_data` / `build_regressor`: a smooth function of 8 features (float targets [n], MSE);
`multilabel_data` / `build_tagger`: 4 independent 0/1 labels per example (a [n, 4] matrix, binary
cross-entropy of logits, accuracy per label). The builders return compiled models: asyncps trains with
the loss and reports the metrics they were compiled with.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

Split = tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


def regression_data(seed: int = 0, n: int = 2400) -> Split:
    """y = x @ w + 0.5 sin(2 x0) + noise (sd 0.05): float32 targets [n] with variance about 4."""
    rng = np.random.default_rng(1000 + seed)
    w = np.random.default_rng(7).normal(size=8)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    y = (x @ w + 0.5 * np.sin(2 * x[:, 0]) + 0.05 * rng.normal(size=n)).astype(np.float32)
    cut = n * 5 // 6
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def build_regressor(input_shape: tuple[int, ...], output_shape: tuple[int, ...], seed: int = 0) -> keras.Model:
    """A small ReLU MLP with a linear output, compiled with mean squared error (and MAE as a metric)."""
    init = keras.initializers.GlorotUniform(seed=seed)
    inputs = keras.Input(shape=input_shape)
    hidden = keras.layers.Dense(32, activation="relu", kernel_initializer=init, name="hidden")(inputs)
    outputs = keras.layers.Dense(int(np.prod(output_shape)), kernel_initializer=init, name="target")(hidden)
    model = keras.Model(inputs, outputs, name="regressor")
    model.compile(loss="mse", metrics=["mae"])
    return model


def multilabel_data(seed: int = 0, n: int = 2400) -> Split:
    """4 labels per example, each 1 where a fixed random direction of the 10 features is positive."""
    rng = np.random.default_rng(2000 + seed)
    directions = np.random.default_rng(11).normal(size=(10, 4))
    x = rng.normal(size=(n, 10)).astype(np.float32)
    y = (x @ directions > 0).astype(np.int64)
    cut = n * 5 // 6
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def build_tagger(input_shape: tuple[int, ...], output_shape: tuple[int, ...], seed: int = 0) -> keras.Model:
    """An MLP with one logit per label, compiled with binary cross-entropy of logits and accuracy."""
    init = keras.initializers.GlorotUniform(seed=seed)
    inputs = keras.Input(shape=input_shape)
    hidden = keras.layers.Dense(16, activation="relu", kernel_initializer=init, name="hidden")(inputs)
    logits = keras.layers.Dense(output_shape[-1], kernel_initializer=init, name="logits")(hidden)
    model = keras.Model(inputs, logits, name="tagger")
    model.compile(loss=keras.losses.BinaryCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def build_two_heads(input_shape: tuple[int, ...]) -> keras.Model:
    """Two outputs, uncompiled: asyncps refuses it with a message (a loss per output is needed)."""
    inputs = keras.Input(shape=input_shape)
    return keras.Model(inputs, [keras.layers.Dense(1, name="a")(inputs), keras.layers.Dense(2, name="b")(inputs)])


def build_sigmoid_tagger(input_shape: tuple[int, ...], output_shape: tuple[int, ...]) -> Any:
    """A tagger whose output applies sigmoid, compiled with a loss of logits: asyncps warns at start."""
    inputs = keras.Input(shape=input_shape)
    outputs = keras.layers.Dense(output_shape[-1], activation="sigmoid", name="probs")(inputs)
    model = keras.Model(inputs, outputs)
    model.compile(loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return model


def squared_error(y_true: Any, y_pred: Any) -> Any:
    """A loss of one's own (`--loss targets:squared_error`): it relies on asyncps giving [n] targets the
    outputs' [n, 1] shape (else the difference would broadcast to [n, n])."""
    return (y_true - y_pred) ** 2
