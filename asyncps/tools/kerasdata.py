"""Data beyond arrays for `asyncps.train`: what `keras.Model.fit` takes as `x`, read here into arrays.

A `tf.data.Dataset`, a `keras.utils.PyDataset`, a generator (or a function that returns one, called once
here) or any other iterator yields batches, as `fit` reads them: `(x, y)` or `(x, y, sample_weight)`. They
are read to their end in the caller's process and joined into the arrays `asyncps.train` sends, so the
chief's data tasks and its exactly-once accounting hold for them as for arrays: every example read is
trained once per epoch. Only a finite source can be read so: an infinite `tf.data.Dataset` (`repeat()`)
or `PyDataset` is refused with what to do (`take(n)`), and an iterator that has not ended after
MAX_EXAMPLES examples is refused instead of read forever. Batches of `(x, y, sample_weight)` bring their
weights (the workers weight each example's loss by them). A batch's x (or y) may be several arrays, a list in
the model's input order or a dict by name, as `fit` reads them: they are joined key by key and packed as
arrays given so are (asyncps.ml.multiio).

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


#: One batch's inputs (or labels): an array, or several as model.fit reads them: a list in the model's order or a
#: dict by name (asyncps.train packs several: asyncps.ml.multiio).
Part = np.ndarray | list[np.ndarray] | dict[str, np.ndarray]


def flat(part: Any) -> dict[str | int, np.ndarray]:
    """A batch's inputs or labels by key: '' for one array, the position in a list or tuple, the name in a dict."""
    if isinstance(part, dict):
        return {str(k): np.asarray(v) for k, v in part.items()}
    if isinstance(part, (tuple, list)):
        return {i: np.asarray(v) for i, v in enumerate(part)}
    return {"": np.asarray(part)}


def shapes(part: Part) -> dict[str | int, tuple[int, ...]]:
    """Each array's example shape (after the first axis), by key as `flat` gives it."""
    return {k: v.shape[1:] for k, v in flat(part).items()}


def join(parts: list[Part]) -> Part:
    """Batches (or workers' sets) of the same keys and example shapes as one: each key's arrays concatenated."""
    flats = [flat(p) for p in parts]
    joined = {k: np.concatenate([f[k] for f in flats]) for k in flats[0]}
    if isinstance(parts[0], dict):
        return {str(k): v for k, v in joined.items()}
    if isinstance(parts[0], (tuple, list)):
        return [joined[i] for i in range(len(joined))]
    return joined[""]


def read(source: Any, what: str) -> tuple[Part, Part, np.ndarray | None]:
    """The examples of a dataset, PyDataset or generator `source` (see the module), joined: (x, y, sample
    weights or None); x and y each an array, or a list or dict of them for several inputs or outputs.
    ValueError, naming `what`, for a source that does not end, batches that are not (x, y) pairs, or batches
    whose shapes or keys differ after the first."""
    how = kind(source)
    if how is None:
        raise ValueError(f"asyncps.train: {what} is not a dataset, PyDataset or generator")
    batches = _batches(source, how, what)
    xs: list[Part] = []
    ys: list[Part] = []
    ws: list[np.ndarray | None] = []
    examples = 0
    for i, batch in enumerate(batches):
        x, y, w = _pair(batch, what, i)
        size = _size(x, y, w, what, i)
        if ws and (w is None) != (ws[0] is None):
            raise ValueError(f"asyncps.train: batch {i} of {what} {'lacks' if w is None else 'has'} sample weights "
                             "and batch 0 does not: all or none")
        ws.append(w)
        if xs and (shapes(x) != shapes(xs[0]) or shapes(y) != shapes(ys[0])):
            raise ValueError(f"asyncps.train: batch {i} of {what} has examples of shape {shown(x)} -> {shown(y)}, "
                             f"batch 0 {shown(xs[0])} -> {shown(ys[0])}")
        xs.append(x)
        ys.append(y)
        examples += size
        if examples > MAX_EXAMPLES:
            raise ValueError(f"asyncps.train: {what} had not ended after {MAX_EXAMPLES:,} examples: give a finite "
                             "one (itertools.islice(generator, batches), dataset.take(batches))")
    if not xs:
        raise ValueError(f"asyncps.train: {what} yielded no batches")
    weights = None if ws[0] is None else np.concatenate([w for w in ws if w is not None])
    return join(xs), join(ys), weights


def shown(part: Part) -> str:
    """Example shapes for a message: `(8,)` for one array, `{'ids': (), 'dense': (8,)}` for several."""
    by_key = shapes(part)
    return str(by_key[""]) if list(by_key) == [""] else str(by_key)


def _size(x: Part, y: Part, w: np.ndarray | None, what: str, i: int) -> int:
    """The batch's example count; ValueError when its inputs, labels and weights disagree on it."""
    lengths = {len(v) for v in (*flat(x).values(), *flat(y).values())}
    if len(lengths) != 1 or (w is not None and w.shape != (min(lengths),)):
        raise ValueError(f"asyncps.train: batch {i} of {what} has {sorted(lengths)} examples across its inputs "
                         "and labels" + ("" if w is None else f" and {w.shape} sample weights"))
    return lengths.pop()


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


def _pair(batch: Any, what: str, i: int) -> tuple[Part, Part, np.ndarray | None]:
    if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
        raise ValueError(f"asyncps.train: batch {i} of {what} is {type(batch).__name__}, not an (x, y) pair "
                         "(as keras.Model.fit reads a dataset)")
    w = None if len(batch) == 2 or batch[2] is None else np.asarray(batch[2], dtype=np.float32).reshape(-1)
    x, y = (_part(v) for v in batch[:2])
    if any(v.ndim == 0 for v in (*flat(x).values(), *flat(y).values())):
        raise ValueError(f"asyncps.train: batch {i} of {what} is not batched (x {shown(x)}, y {shown(y)}): "
                         "batch it (dataset.batch(n)), as keras.Model.fit reads one")
    return x, y, w


def _part(value: Any) -> Part:
    """A batch's x or y as arrays: one, a list of them (from a list or tuple), or a dict of them."""
    if isinstance(value, dict):
        return {str(k): np.asarray(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [np.asarray(v) for v in value]
    return np.asarray(value)


__all__ = ["MAX_EXAMPLES", "Part", "flat", "join", "kind", "read", "shapes", "shown"]
