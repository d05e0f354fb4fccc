"""Evaluation of the current model on held-out data, on the run's schedule.

A model whose Embedding tables are read by rows (asyncps.ml.sparse) is evaluated on a clone with local
tables of capacity for one evaluation batch: per batch, the rows it looks up are fed (`RowSource`), so
the chief never holds a table. A scheduled evaluation pulls the dense variables and the rows the test
set looks up at one cut (as today's whole pull), then computes batch by batch from those rows.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from asyncps.chief.cut import CutLapsed, pull_at_cut
from asyncps.chief.progress import Progress, TrainClock
from asyncps.chief.recorder import EvalLog

from asyncps.rundir import write_npz
from asyncps.wire.codec import Array, IndexArray, SparseRows

if TYPE_CHECKING:
    from pathlib import Path

    from asyncps.ml.datasets import Dataset
    from asyncps.ml.sparse import SparseModel
    from asyncps.ml.task import Task
    from asyncps.transport import ModelClient

log = logging.getLogger("asyncps.chief")

#: Where a batch's table rows come from: ids of each table (sorted, distinct) -> their rows.
RowSource = Callable[[Mapping[str, IndexArray]], Mapping[str, SparseRows]]

#: Ids asked of the shards per pull when the rows of a whole test set are read (a shard serves at most
#: 2^20 rows of a part per read).
ROWS_PER_PULL = 1 << 18


def zero_rows(ids: Mapping[str, IndexArray], sparse: SparseModel) -> dict[str, SparseRows]:
    """Rows of zeros for the ids asked (tracing the evaluation before the shards hold anything)."""
    dims = {t.variable: (t.shape[1:], t.dtype) for t in sparse.tables}
    return {name: SparseRows(i, np.zeros((i.size, *dims[name][0]), dims[name][1]), np.zeros(i.size, np.int64))
            for name, i in ids.items()}


def pull_rows(client: ModelClient, ids: Mapping[str, IndexArray]) -> dict[str, SparseRows]:
    """The rows of `ids` pulled from the shards (ROWS_PER_PULL ids a pull), joined per table."""
    pieces: dict[str, list[SparseRows]] = {name: [] for name in ids}
    longest = max((i.size for i in ids.values()), default=0)
    for start in range(0, max(1, longest), ROWS_PER_PULL):
        client.pull(rows={name: i[start:start + ROWS_PER_PULL] for name, i in ids.items()})
        for name in ids:
            pieces[name].append(client.rows[name])
    return {name: SparseRows(ids[name], np.concatenate([p.values for p in got]),
                             np.concatenate([p.clocks for p in got if p.clocks is not None]))
            for name, got in pieces.items()}


class HeldRows:
    """Rows read once (at a cut) serving every batch whose ids are among them."""

    def __init__(self, rows: Mapping[str, SparseRows]) -> None:
        self._rows = rows

    def __call__(self, ids: Mapping[str, IndexArray]) -> dict[str, SparseRows]:
        """The held rows of `ids` (KeyError naming an id not held)."""
        out = {}
        for name, want in ids.items():
            held = self._rows[name]
            at = np.searchsorted(held.indices, want)
            if want.size and (at.max() >= held.indices.size or not np.array_equal(held.indices[at], want)):
                raise KeyError(f"{name}: rows asked that were not read")
            out[name] = SparseRows(want, held.values[at], None if held.clocks is None else held.clocks[at])
        return out


class Evaluator:
    """Loads parameter values into a Keras model and measures the task's loss, accuracy (NaN where the
    task is not classification) and metrics on (x, y)."""

    def __init__(self, model: Any, task: Task, batch_size: int = 1024, sparse: SparseModel | None = None,
                 rows: RowSource | None = None) -> None:
        """`sparse`: the model's tables read by rows (`model` is its clone, of capacity for `batch_size`);
        `rows`: where each batch's rows come from (by default rows of zeros; Evaluation sets it)."""
        import keras
        import tensorflow as tf

        self._model = model
        self.sparse = sparse
        tables = {t.variable for t in sparse.tables} if sparse is not None else set()
        from asyncps.ml.models import state_variables

        held = [*model.trainable_variables, *state_variables(model, sparse.fed if sparse is not None else ())]
        self._tables = {v.path: v for v in held if v.path in tables}
        self._variables = {v.path: v for v in held if v.path not in tables}
        self.rows: RowSource | None = rows
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
        """Copy parameter values into the model (the tables' rows come per batch, from `rows`)."""
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
            self._feed(bx)
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

    def _feed(self, x: Array) -> None:
        """The local tables and their row ids for one batch (nothing for a model without tables)."""
        if self.sparse is None:
            return
        ids = self.sparse.batch_ids(x)
        step = self.sparse.step(self.rows(ids) if self.rows is not None else zero_rows(ids, self.sparse))
        for name, table in step.tables.items():
            self._tables[name].assign(table)
        for variable, fed in zip(self.sparse.fed, step.fed, strict=True):
            variable.assign(fed)

    def ids(self, x: Array) -> dict[str, IndexArray]:
        """Every id each table's rows an evaluation of `x` looks up (sorted, distinct)."""
        assert self.sparse is not None
        per_batch = [self.sparse.batch_ids(x[s:s + self._batch]) for s in range(0, len(x), self._batch)]
        return {t.variable: np.unique(np.concatenate([b[t.variable] for b in per_batch] or [np.zeros(0, np.int64)]))
                for t in self.sparse.tables}

    def values(self) -> dict[str, Array]:
        """The model's current values (without its tables)."""
        return {name: np.array(var.numpy()) for name, var in self._variables.items()}


class Evaluation:
    """The run's evaluations: pull the model at a cut, measure it on the test set, publish
    the result to Progress (GetStatus) and to the EvalLog; every `every_s` seconds of training."""

    def __init__(self, evaluator: Evaluator, client: ModelClient, data: Dataset, every_s: float,
                 progress: Progress, clock: TrainClock, record: EvalLog,
                 weights_to: Callable[[int], Path] | None = None) -> None:
        """`weights_to`: where the values each evaluation measured are written, by its update count (before its
        eval.csv row, so a reader of the row finds them; tables read by rows left out), or nowhere."""
        self._weights_to = weights_to
        self._evaluator = evaluator
        self._client = client
        self._data = data
        self._every_s = every_s
        self._progress = progress
        self._clock = clock
        self._record = record
        self._last = 0.0  # monotonic time of the last scheduled evaluation
        self._test_ids: dict[str, IndexArray] | None = None  # the rows the test set looks up, per table

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
        evaluator = self._evaluator
        held: dict[str, SparseRows] = {}
        read_rows = None
        if evaluator.sparse is not None:
            if self._test_ids is None:
                self._test_ids = evaluator.ids(self._data.x_test)
            ids = self._test_ids
            read_rows = lambda: held.update(pull_rows(self._client, ids))  # noqa: E731
        try:
            versions = pull_at_cut(self._client, then=read_rows)
        except CutLapsed as exc:  # still each shard's values at its own version, just not one cut
            log.warning("evaluation: %s", exc)
            versions = list(self._client.versions)
        evaluator.load(self._client.values)
        evaluator.rows = HeldRows(held)
        try:
            loss, accuracy = evaluator.evaluate(self._data.x_test, self._data.y_test)
        finally:  # later evaluations (the final training loss) pull their rows per batch
            evaluator.rows = lambda ids: pull_rows(self._client, ids)
        updates = round(sum(versions) / len(versions))
        if self._weights_to is not None:
            write_npz(self._weights_to(updates), evaluator.values())
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
