"""TensorFlow's parameter-server input habits for `asyncps.train`: a `dataset_fn(context)` that builds each worker's
`tf.data.Dataset`, and `steps_per_epoch` for sources that never end.

Both are read in the caller's process into the arrays `asyncps.train` sends (asyncps.tools.kerasdata joins the
batches). Why here and not on each worker: the chief hands out data tasks over one indexed training set and counts
every example exactly once per epoch (its accounting, summary.json's `data`); a pipeline each worker drained on its
own would be consumed outside that accounting (a worker that dies mid-pipeline would lose or repeat its examples).
So `dataset_fn` (a function, or a `package.module:function` spec imported here) is called here once per worker,
with the `InputContext` it would get on that worker (its `worker_index` of `num_workers`), each dataset is read to
its end (or to its share of `steps_per_epoch` batches), and the workers' examples are joined in worker order.
Nothing of the function travels, only the arrays: a lambda or a function defined in a notebook works as an
importable one does. The examples must fit in the caller's memory (and the run directory, as an .npz).

`steps_per_epoch` (as `model.fit` takes it) is the number of batches read: from `x=`'s source, or in total from the
workers' datasets (worker i reads `steps // num_workers` batches, one more for the first `steps % num_workers`).
For an endless source (`repeat()`, a generator that never returns, a PyDataset without a length) those batches are
the epoch: every epoch trains the same examples, each once, and the accounting counts them; the stream past them
is never read (unlike `model.fit`, whose next epoch reads on).
"""

from __future__ import annotations

import collections.abc
import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncps.ml.userfns import load_function
from asyncps.tools import kerasdata

Examples = tuple[kerasdata.Part, kerasdata.Part, np.ndarray | None]


@dataclass(frozen=True)
class InputContext:
    """What a `dataset_fn` learns of the worker it builds a dataset for, under the names of both asyncps
    (`worker_index`, `num_workers`) and `tf.distribute.InputContext` (`input_pipeline_id`, `num_input_pipelines`,
    `get_per_replica_batch_size`), so a function written for TF's ParameterServerStrategy runs unchanged."""

    worker_index: int
    num_workers: int

    @property
    def input_pipeline_id(self) -> int:
        """TF's name for the worker's index."""
        return self.worker_index

    @property
    def num_input_pipelines(self) -> int:
        """TF's name for the number of workers (one pipeline each)."""
        return self.num_workers

    @property
    def num_replicas_in_sync(self) -> int:
        """The replicas a global batch is shared by: one per worker."""
        return self.num_workers

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """One worker's share of a global batch size (ValueError when it does not divide, as TF's)."""
        if global_batch_size % self.num_workers:
            raise ValueError(f"the global batch size {global_batch_size} is not divisible by the "
                             f"{self.num_workers} workers")
        return global_batch_size // self.num_workers


def read_inputs(x: Any, y: Any, sample_weight: Any, dataset_fn: Callable[..., Any] | str | None,
                steps_per_epoch: int | None, num_workers: Any) -> tuple[Any, Any, Any]:
    """(x, y, sample_weight) with a `dataset_fn`'s datasets, or a source cut to `steps_per_epoch` batches, read into
    arrays (batches' own weights as sample_weight); anything else unchanged, an endless source refused."""
    if steps_per_epoch is not None and (isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int)
                                        or steps_per_epoch < 1):
        raise ValueError(f"asyncps.train: steps_per_epoch must be a positive integer, got {steps_per_epoch!r}")
    if dataset_fn is None and steps_per_epoch is None:
        if kerasdata.kind(x) is not None:
            refuse_endless(x, "x")
        return x, y, sample_weight
    if x is not None or y is not None:
        if dataset_fn is not None:
            raise ValueError("asyncps.train: dataset_fn= builds the training data; do not give x= or y= as well")
        if kerasdata.kind(x) is None:
            raise ValueError("asyncps.train: steps_per_epoch= bounds a dataset, PyDataset or generator (x= or "
                             "dataset_fn=); arrays are trained whole every epoch")
        if y is not None:
            raise ValueError("asyncps.train: x= is a dataset of (x, y) batches; do not give y= as well")
    if dataset_fn is not None:
        xs, ys, weights = from_dataset_fn(dataset_fn, _count(num_workers), steps_per_epoch)
    else:
        xs, ys, weights = kerasdata.read(bounded(x, steps_per_epoch, "x"), "x")
    if weights is not None and sample_weight is not None:
        raise ValueError("asyncps.train: the batches bring sample weights; do not give sample_weight= as well")
    return xs, ys, weights if weights is not None else sample_weight


def from_dataset_fn(dataset_fn: Callable[..., Any] | str, num_workers: int, steps: int | None) -> Examples:
    """Every worker's examples, in worker order: `dataset_fn` (a function or a `package.module:function` spec)
    called with each worker's InputContext, each dataset read to its end (or to the worker's share of `steps`
    batches)."""
    if isinstance(dataset_fn, str):
        dataset_fn = load_function(dataset_fn, "dataset_fn")
    if not callable(dataset_fn) or kerasdata.kind(dataset_fn) not in ("function", None):
        raise ValueError(f"asyncps.train: dataset_fn must be a function of the worker's context returning a "
                         f"tf.data.Dataset, got {type(dataset_fn).__name__}")
    parts: list[Examples] = []
    for index in range(num_workers):
        share = None if steps is None else steps // num_workers + (index < steps % num_workers)
        if share == 0:
            continue  # fewer steps than workers: the last workers' datasets are not read
        what = f"dataset_fn's dataset for worker {index}"
        source = _call(dataset_fn, InputContext(worker_index=index, num_workers=num_workers))
        if kerasdata.kind(source) in (None, "function"):
            raise ValueError(f"asyncps.train: {what} is {type(source).__name__}, not a tf.data.Dataset, "
                             "PyDataset or generator of (x, y) batches")
        if share is None:
            refuse_endless(source, what)
        parts.append(kerasdata.read(bounded(source, share, what), what))
    return _join(parts)


def bounded(source: Any, steps: int | None, what: str) -> Any:
    """`source` cut to its first `steps` batches (as it is for None), whether it ends or not."""
    if steps is None:
        return source
    how = kerasdata.kind(source)
    if how == "tf.data":
        return source.take(steps)
    if how == "PyDataset":
        count = source.num_batches
        return (source[i] for i in range(steps if count is None else min(steps, int(count))))
    made = source() if how == "function" else source
    if not isinstance(made, collections.abc.Iterable):
        raise ValueError(f"asyncps.train: {what} is a function that returned {type(made).__name__}, not an "
                         "iterator of (x, y) batches")
    return itertools.islice(made, steps)


def refuse_endless(source: Any, what: str) -> None:
    """ValueError for a source known to be endless (an infinite tf.data.Dataset, a PyDataset without a length):
    without `steps_per_epoch` an epoch has no end. (A generator's end cannot be told: kerasdata stops reading one
    after its MAX_EXAMPLES.)"""
    how = kerasdata.kind(source)
    if how == "tf.data":
        import tensorflow as tf

        endless = int(source.cardinality()) == int(tf.data.INFINITE_CARDINALITY)
    else:
        endless = how == "PyDataset" and source.num_batches is None
    if endless:
        name = "an infinite tf.data.Dataset (repeat())" if how == "tf.data" else "a PyDataset without a length"
        raise ValueError(f"asyncps.train: {what} is {name}: an epoch needs its end; give steps_per_epoch= (the "
                         "batches read, trained once every epoch) or a finite one (dataset.take(batches))")


def _count(num_workers: Any) -> int:
    """The num_workers setting as a count (as given to train: an int or its text), ValueError for anything else."""
    try:
        count = int(num_workers)
    except (TypeError, ValueError):
        count = 0
    if count < 1 or isinstance(num_workers, bool) or str(count) != str(num_workers).strip():
        raise ValueError(f"asyncps.train: num_workers must be a positive integer, got {num_workers!r}")
    return count


def _call(dataset_fn: Callable[..., Any], context: InputContext) -> Any:
    """dataset_fn(context), or dataset_fn() for a function that takes no argument."""
    try:
        takes = bool(inspect.signature(dataset_fn).parameters)
    except (TypeError, ValueError):
        takes = True
    return dataset_fn(context) if takes else dataset_fn()


def _join(parts: list[Examples]) -> Examples:
    """The workers' examples as one set; ValueError when their shapes, keys or weighting differ."""
    first_x, first_y, first_w = parts[0]
    for index, (x, y, w) in enumerate(parts[1:], start=1):
        if kerasdata.shapes(x) != kerasdata.shapes(first_x) or kerasdata.shapes(y) != kerasdata.shapes(first_y) \
                or (w is None) != (first_w is None):
            raise ValueError(f"asyncps.train: dataset_fn's datasets differ: worker {index}'s examples are "
                             f"{kerasdata.shown(x)} -> {kerasdata.shown(y)}{'' if w is None else ' weighted'}, "
                             f"the first's {kerasdata.shown(first_x)} -> {kerasdata.shown(first_y)}"
                             f"{'' if first_w is None else ' weighted'}")
    weights = None if first_w is None else np.concatenate([w for _, _, w in parts if w is not None])
    return kerasdata.join([x for x, _, _ in parts]), kerasdata.join([y for _, y, _ in parts]), weights


__all__ = ["InputContext", "bounded", "from_dataset_fn", "read_inputs", "refuse_endless"]
