"""Evaluation of the current model on held-out data, on the run's schedule."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from asyncps.chief.cut import CutLapsed, pull_at_cut
from asyncps.chief.progress import Progress, TrainClock
from asyncps.chief.recorder import EvalLog

from asyncps.wire.codec import Array

if TYPE_CHECKING:
    from asyncps.ml.datasets import Dataset
    from asyncps.ml.task import Task
    from asyncps.transport import ModelClient

log = logging.getLogger("asyncps.chief")


class Evaluator:
    """Loads parameter values into a Keras model and measures the task's loss, accuracy (NaN where the
    task is not classification) and metrics on (x, y)."""

    def __init__(self, model: Any, task: Task, batch_size: int = 1024) -> None:
        import keras
        import tensorflow as tf

        self._model = model
        self._variables = {v.path: v for v in model.trainable_variables}
        self._batch = batch_size
        self._task = task
        loss_fn = task.loss
        self._stateful = {n: m for n, m in task.metrics.items() if isinstance(m, keras.metrics.Metric)}
        self._metric_names = [n for n in task.metrics if n not in self._stateful]
        metric_fns = [task.metrics[n] for n in self._metric_names]
        argmax = task.accuracy == "argmax"
        #: The metrics of the last evaluate(), by name.
        self.last_metrics: dict[str, float] = {}

        @tf.function(reduce_retracing=True)  # type: ignore[untyped-decorator]
        def batch_metrics(x: Any, y: Any) -> tuple[Any, Any, list[Any], Any]:
            outputs = model(x, training=False)
            n = tf.cast(tf.shape(y)[0], tf.float32)
            loss = loss_fn(outputs, y) * n
            correct = (tf.reduce_sum(tf.cast(tf.equal(tf.argmax(outputs, axis=-1), tf.cast(y, tf.int64)), tf.float32))
                       if argmax else tf.constant(0.0))
            sums = []
            for fn in metric_fns:  # per-example values are summed (a mean per example first), a batch mean weighted
                value = tf.cast(fn(y, outputs), tf.float32)
                if value.shape.rank and value.shape.rank > 1:
                    value = tf.reduce_mean(tf.reshape(value, [tf.shape(value)[0], -1]), axis=1)
                sums.append(tf.reduce_sum(value) if value.shape.rank else value * n)
            return loss, correct, sums, outputs

        self._batch_metrics = batch_metrics

    @property
    def accuracy_is_a_metric(self) -> bool:
        """True when the accuracy is one of the task's metrics (reported with them), not the argmax hits."""
        return self._task.accuracy not in (None, "argmax")

    def load(self, values: Mapping[str, Array]) -> None:
        """Copy parameter values into the model."""
        for name, var in self._variables.items():
            var.assign(values[name])

    def warm_up(self, x: Array, y: Array) -> None:
        """Trace the evaluation for a whole batch and for a partial one (the last batch of a test set), on
        a few test examples: done before training starts, so the run's first evaluation does not hold the
        chief's control loop (stop conditions, checkpoints) for the tracing — seconds on a loaded machine,
        while the workers went on pushing (a 300-update run once applied 846 before it was told to stop)."""
        n = min(len(x), self._batch + 1)
        self.evaluate(x[:n], y[:n])
        self.last_metrics = {}

    def evaluate(self, x: Array, y: Array) -> tuple[float, float]:
        """Mean loss and accuracy over (x, y); accuracy is NaN when the task is not classification."""
        total_loss, total_correct = 0.0, 0.0
        totals = [0.0] * len(self._metric_names)
        for metric in self._stateful.values():
            metric.reset_state()
        for start in range(0, len(x), self._batch):
            bx, by = x[start:start + self._batch], y[start:start + self._batch]
            loss, correct, sums, outputs = self._batch_metrics(bx, by)
            total_loss += float(loss.numpy())
            total_correct += float(correct.numpy())
            totals = [t + float(v.numpy()) for t, v in zip(totals, sums, strict=True)]
            for metric in self._stateful.values():
                metric.update_state(by, outputs)
        n = max(1, len(x))
        measured = {name: t / n for name, t in zip(self._metric_names, totals, strict=True)}
        measured.update({name: float(m.result()) for name, m in self._stateful.items()})
        self.last_metrics = {name: measured[name] for name in self._task.metrics}
        if self._task.accuracy == "argmax":
            accuracy = total_correct / n
        elif self._task.accuracy is not None:
            accuracy = self.last_metrics[self._task.accuracy]
        else:
            accuracy = math.nan
        return total_loss / n, accuracy

    def values(self) -> dict[str, Array]:
        """The model's current values."""
        return {name: np.array(var.numpy()) for name, var in self._variables.items()}


class Evaluation:
    """The run's evaluations: pull the model at a cut, measure it on the test set, publish
    the result to Progress (GetStatus) and to the EvalLog; every `every_s` seconds of training."""

    def __init__(self, evaluator: Evaluator, client: ModelClient, data: Dataset, every_s: float,
                 progress: Progress, clock: TrainClock, record: EvalLog) -> None:
        self._evaluator = evaluator
        self._client = client
        self._data = data
        self._every_s = every_s
        self._progress = progress
        self._clock = clock
        self._record = record
        self._last = 0.0  # monotonic time of the last scheduled evaluation

    def due(self) -> bool:
        """Training runs and the last scheduled evaluation is `every_s` old."""
        return self._clock.started and time.monotonic() - self._last >= self._every_s

    def scheduled(self) -> None:
        """An evaluation on the schedule (the next one is due `every_s` after it ends, or after it failed)."""
        try:
            self.evaluate()
        finally:
            self._last = time.monotonic()

    def evaluate(self) -> tuple[float, float]:
        """Evaluate the model at a cut (asyncps.chief.cut: every shard holds pushes while the whole
        model is pulled); record the version vector of exactly those values; return (loss, accuracy)."""
        try:
            versions = pull_at_cut(self._client)
        except CutLapsed as exc:  # still each shard's values at its own version, just not one cut
            log.warning("evaluation: %s", exc)
            versions = list(self._client.versions)
        self._evaluator.load(self._client.values)
        loss, accuracy = self._evaluator.evaluate(self._data.x_test, self._data.y_test)
        updates = round(sum(versions) / len(versions))
        elapsed = self._clock.elapsed()
        with self._progress.lock:
            self._progress.eval_loss, self._progress.eval_accuracy = loss, accuracy
            self._progress.eval_updates = updates
            self._progress.eval_metrics = dict(self._evaluator.last_metrics)
        self._record.add(elapsed, updates, versions, loss, accuracy, self._progress.updates_per_s,
                         self._evaluator.last_metrics)
        log.info("eval at %d updates: loss %.4f%s%s", updates, loss,
                 "" if math.isnan(accuracy) or self._evaluator.accuracy_is_a_metric else f" accuracy {accuracy:.4f}",
                 "".join(f" {k} {v:.4f}" for k, v in self._evaluator.last_metrics.items()))
        return loss, accuracy
