"""Data beyond arrays for `asyncps.train`: what `keras.Model.fit` takes as `x`, read here into arrays.

A `tf.data.Dataset`, a `keras.utils.PyDataset`, a generator (or a function that returns one, called once
here) or any other iterator yields batches, as `fit` reads them: `(x, y)` or `(x, y, sample_weight)`. They
are read to their end in the caller's process and joined into the arrays `asyncps.train` sends, so the
chief's data tasks and its exactly-once accounting hold for them as for arrays: every example read is
trained once per epoch. Only a finite source can be read so: an infinite `tf.data.Dataset` (`repeat()`)
or `PyDataset` is refused with what to do (`take(n)`), and an iterator that has not ended after
MAX_EXAMPLES examples is refused instead of read forever. Batches of `(x, y, sample_weight)` bring their
weights (the workers weight each example's loss by them).

A `dataset_fn` per worker (TF's parameter-server habit) and `steps_per_epoch` for endless sources: see
asyncps.tools.datainput, which reads them through `read`.
"""

from __future__ import annotations

import collections.abc
import inspect
from typing import Any

import numpy as np

#: The most examples read from an iterator before it is refused as endless (a generator that never ends).
MAX_EXAMPLES = 20_000_000


def kind(source: Any) -> str | None:
    """What `source` is, as `asyncps.train` reads it: "tf.data", "PyDataset", "iterator", "function", or None
    for anything else (arrays, lists: numpy reads them)."""
    if source is None or isinstance(source, (np.ndarray, list, tuple, dict)):
        return None
    module = type(source).__module__ or ""
    if module.startswith("tensorflow") and hasattr(source, "element_spec"):
        return "tf.data"
    if module.startswith("keras") or hasattr(source, "num_batches"):
        import keras

        if isinstance(source, keras.utils.PyDataset):
            return "PyDataset"
    if isinstance(source, collections.abc.Iterator):
        return "iterator"
    if inspect.isgeneratorfunction(source) or (callable(source) and not hasattr(source, "shape")):
        return "function"
    return None


def read(source: Any, what: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The examples of a dataset, PyDataset or generator `source` (see the module), joined: (x, y, sample
    weights or None).
    ValueError, naming `what`, for a source that does not end, batches that are not (x, y) pairs, or batches
    whose shapes differ after the first axis."""
    how = kind(source)
    if how is None:
        raise ValueError(f"asyncps.train: {what} is not a dataset, PyDataset or generator")
    batches = _batches(source, how, what)
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    ws: list[np.ndarray | None] = []
    examples = 0
    for i, batch in enumerate(batches):
        x, y, w = _pair(batch, what, i)
        if len(x) != len(y) or (w is not None and w.shape != (len(x),)):
            raise ValueError(f"asyncps.train: batch {i} of {what} has {len(x)} inputs but {len(y)} labels"
                             + ("" if w is None else f" and {w.shape} sample weights"))
        if ws and (w is None) != (ws[0] is None):
            raise ValueError(f"asyncps.train: batch {i} of {what} {'lacks' if w is None else 'has'} sample weights "
                             "and batch 0 does not: all or none")
        ws.append(w)
        if xs and (x.shape[1:] != xs[0].shape[1:] or y.shape[1:] != ys[0].shape[1:]):
            raise ValueError(f"asyncps.train: batch {i} of {what} has examples of shape {x.shape[1:]} -> "
                             f"{y.shape[1:]}, batch 0 {xs[0].shape[1:]} -> {ys[0].shape[1:]}")
        xs.append(x)
        ys.append(y)
        examples += len(x)
        if examples > MAX_EXAMPLES:
            raise ValueError(f"asyncps.train: {what} had not ended after {MAX_EXAMPLES:,} examples: give a finite "
                             "one (itertools.islice(generator, batches), dataset.take(batches))")
    if not xs:
        raise ValueError(f"asyncps.train: {what} yielded no batches")
    weights = None if ws[0] is None else np.concatenate([w for w in ws if w is not None])
    return np.concatenate(xs), np.concatenate(ys), weights


def _batches(source: Any, how: str, what: str) -> collections.abc.Iterable[Any]:
    if how == "tf.data":
        import tensorflow as tf

        if int(source.cardinality()) == int(tf.data.INFINITE_CARDINALITY):
            raise ValueError(f"asyncps.train: {what} is an infinite tf.data.Dataset (repeat()): an epoch needs its "
                             "end; give a finite one (dataset.take(batches)), asyncps repeats it per epoch")
        return source.as_numpy_iterator()  # type: ignore[no-any-return]
    if how == "PyDataset":
        count = source.num_batches
        if count is None:
            raise ValueError(f"asyncps.train: {what} is a PyDataset without a length (num_batches None): an "
                             "epoch needs its end; give one with __len__")
        return (source[i] for i in range(int(count)))
    if how == "function":
        made = source()
        if not isinstance(made, collections.abc.Iterable):
            raise ValueError(f"asyncps.train: {what} is a function that returned {type(made).__name__}, not an "
                             "iterator of (x, y) batches")
        return made  # type: ignore[no-any-return]
    return source  # type: ignore[no-any-return]


def _pair(batch: Any, what: str, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
        raise ValueError(f"asyncps.train: batch {i} of {what} is {type(batch).__name__}, not an (x, y) pair "
                         "(as keras.Model.fit reads a dataset)")
    w = None if len(batch) == 2 or batch[2] is None else np.asarray(batch[2], dtype=np.float32).reshape(-1)
    x, y = batch[0], batch[1]
    if isinstance(x, dict) or isinstance(y, dict) or isinstance(x, (tuple, list)):
        raise ValueError(f"asyncps.train: batch {i} of {what} has several inputs or outputs: asyncps.train "
                         "takes one input array and one label array per batch")
    x, y = np.asarray(x), np.asarray(y)
    if x.ndim == 0 or y.ndim == 0:
        raise ValueError(f"asyncps.train: batch {i} of {what} is not batched (x {x.shape}, y {y.shape}): "
                         "batch it (dataset.batch(n)), as keras.Model.fit reads one")
    return x, y, w


__all__ = ["MAX_EXAMPLES", "kind", "read"]
