"""Evaluation of the current model on held-out data."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from asyncps.codec import Array


class Evaluator:
    """Loads parameter values into a Keras model and measures loss and accuracy on (x, y)."""

    def __init__(self, model: Any, loss_fn: Any, batch_size: int = 1024) -> None:
        import tensorflow as tf

        self._model = model
        self._variables = {v.path: v for v in model.trainable_variables}
        self._batch = batch_size

        @tf.function(reduce_retracing=True)  # type: ignore[untyped-decorator]
        def batch_metrics(x: Any, y: Any) -> tuple[Any, Any]:
            logits = model(x, training=False)
            loss = loss_fn(logits, y) * tf.cast(tf.shape(y)[0], tf.float32)
            correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, axis=-1), tf.cast(y, tf.int64)), tf.float32))
            return loss, correct

        self._batch_metrics = batch_metrics

    def load(self, values: Mapping[str, Array]) -> None:
        """Copy parameter values into the model."""
        for name, var in self._variables.items():
            var.assign(values[name])

    def evaluate(self, x: Array, y: Array) -> tuple[float, float]:
        """Mean loss and accuracy over (x, y)."""
        total_loss, total_correct = 0.0, 0.0
        for start in range(0, len(x), self._batch):
            loss, correct = self._batch_metrics(x[start:start + self._batch], y[start:start + self._batch])
            total_loss += float(loss.numpy())
            total_correct += float(correct.numpy())
        n = max(1, len(x))
        return total_loss / n, total_correct / n

    def values(self) -> dict[str, Array]:
        """The model's current values."""
        return {name: np.array(var.numpy()) for name, var in self._variables.items()}
