"""Tables read by rows: a worker computes on the rows its batch touches, never on a whole table.

A Keras `Embedding` reads its table through a gather, so a step needs only the rows of the ids in its
batch. For every such layer (whatever feeds it: the model's input or ids the model computes), the
worker builds the user's model without making its tables (variables left uninitialized), and clones
it with each Embedding replaced by a `LocalRows` layer of the same name: a local table of `capacity`
rows (the most distinct ids one batch can hold) and the sorted ids of the rows it holds, which maps
each id to its local row by a binary search inside the computation. Per step (`RowStep`): the ids the
batch looks up are computed (straight from the input when the layer reads it, else by the model's
prefix), the shards serve exactly those rows, the gradient comes back as rows of the local table and
is pushed as rows of the whole table, with the clocks the rows were read at (per-row staleness).

The variables keep their paths, so placement, checkpoints and the chief see the whole tables: a
table's spec is its full shape (`SparseModel.specs`), its rows partitioned over the shards like any
large variable. Models this cannot clone (subclassed ones) train with their tables pulled whole.

A `HashEmbedding` is the same with ids of any int64 value (hashed user or item ids): its table is keyed
on the shards (ps/keyed.py: a row made by the first push naming its key, the least recently pushed
evicted past `rows`), so it is only ever read by rows; a model that cannot be read by rows is refused.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from asyncps.placement import VariableSpec
from asyncps.rules.initializers import RowInit
from asyncps.wire.codec import Array, Gradient, IndexArray, SparseRows, aligned_zeros

log = logging.getLogger(__name__)

#: Pads a LocalRows' sorted ids past the rows it holds (no id of a batch reaches it).
PAD_ID = np.iinfo(np.int64).max


@keras.saving.register_keras_serializable(package="asyncps")
class LocalRows(keras.layers.Layer):  # type: ignore[misc]  # keras is untyped
    """An Embedding that holds only some rows of its table: `capacity` rows and their ids (sorted, padded
    with PAD_ID), which the worker sets for each batch. Looks up ids of the whole table."""

    def __init__(self, capacity: int, output_dim: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.capacity = capacity
        self.output_dim = output_dim

    def build(self, input_shape: Any) -> None:
        """The local table (trainable: its gradient is the step's) and its row ids (state the worker sets)."""
        self.embeddings = self.add_weight(shape=(self.capacity, self.output_dim), initializer="zeros",
                                          name="embeddings")
        self.row_ids = self.add_weight(shape=(self.capacity,), initializer="zeros", dtype="int64",
                                       trainable=False, name="row_ids")

    def call(self, inputs: Any) -> Any:
        """Rows of the ids `inputs` (any shape): each id's position among the held ids, then a gather."""
        ids = tf.cast(inputs, tf.int64)
        flat = tf.reshape(ids, [1, -1])
        local = tf.searchsorted(tf.reshape(self.row_ids, [1, -1]), flat, side="left")
        # an id the rows held do not have (only before the worker set them: tracing) reads the last row
        local = tf.minimum(local, self.capacity - 1)
        rows = tf.gather(self.embeddings, tf.reshape(local, [-1]))
        return tf.reshape(rows, tf.concat([tf.shape(ids), [self.output_dim]], axis=0))

    def compute_output_shape(self, input_shape: Any) -> tuple[Any, ...]:
        """The input's shape and one more axis of output_dim."""
        return (*tuple(input_shape), self.output_dim)

    def get_config(self) -> dict[str, Any]:
        """Capacity and output_dim beside the base config."""
        return {**super().get_config(), "capacity": self.capacity, "output_dim": self.output_dim}


@keras.saving.register_keras_serializable(package="asyncps")
class HashEmbedding(keras.layers.Embedding):  # type: ignore[misc]  # keras is untyped
    """An Embedding looked up by int64 ids of any value (hashed user or item ids, no vocabulary), whose table
    asyncps keeps on the shards by key: `rows` is the most rows it keeps over all shards (each shard its
    share; past it the least recently trained row gives way), `output_dim` a row's width. A key's row is
    made from `embeddings_initializer` (one the shards can make: uniform, normal, truncated normal,
    constant or zeros) when a push first names it.

    Outside asyncps (a plain Keras fit or predict) it is the hashing trick: key mod `rows` picks a row of a
    table of `rows` rows."""

    def __init__(self, rows: int, output_dim: int, **kwargs: Any) -> None:
        kwargs.pop("input_dim", None)  # from_config: rows is the table's input_dim
        if kwargs.get("mask_zero"):
            raise ValueError("HashEmbedding has no padding id (mask_zero): every key is a row")
        super().__init__(input_dim=rows, output_dim=output_dim, **kwargs)

    @property
    def rows(self) -> int:
        """The most rows the table keeps."""
        return int(self.input_dim)

    def call(self, inputs: Any) -> Any:
        """The rows of keys mod `rows` (plain Keras; asyncps replaces the layer by LocalRows of the keys)."""
        return super().call(tf.math.floormod(tf.cast(inputs, tf.int64), self.input_dim))

    def get_config(self) -> dict[str, Any]:
        """The Embedding's config with `rows` for input_dim."""
        config: dict[str, Any] = super().get_config()
        config["rows"] = config.pop("input_dim")
        return config


@keras.saving.register_keras_serializable(package="asyncps")
class KeyedTable(keras.layers.Layer):  # type: ignore[misc]  # keras is untyped
    """A trained HashEmbedding as the exported model holds it: the keys its table kept (sorted) and their rows;
    a key it did not keep looks up a row of zeros (a serving default: it was never trained, or was evicted)."""

    def __init__(self, size: int, output_dim: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.size = max(1, size)
        self.output_dim = output_dim

    def build(self, input_shape: Any) -> None:
        """The kept keys (int64, sorted; padded with PAD_ID when none) and their rows."""
        self.keys = self.add_weight(shape=(self.size,), initializer="zeros", dtype="int64", trainable=False,
                                    name="keys")
        self.embeddings = self.add_weight(shape=(self.size, self.output_dim), initializer="zeros",
                                          name="embeddings")

    def call(self, inputs: Any) -> Any:
        """Each key's row if the table kept it, else zeros."""
        ids = tf.cast(inputs, tf.int64)
        flat = tf.reshape(ids, [-1])
        at = tf.minimum(tf.searchsorted(tf.reshape(self.keys, [1, -1]), tf.reshape(flat, [1, -1]))[0],
                        self.size - 1)
        found = tf.cast(tf.equal(tf.gather(self.keys, at), flat), self.embeddings.dtype)
        rows = tf.gather(self.embeddings, at) * found[:, None]
        return tf.reshape(rows, tf.concat([tf.shape(ids), [self.output_dim]], axis=0))

    def compute_output_shape(self, input_shape: Any) -> tuple[Any, ...]:
        """The input's shape and one more axis of output_dim."""
        return (*tuple(input_shape), self.output_dim)

    def get_config(self) -> dict[str, Any]:
        """size and output_dim beside the base config."""
        config: dict[str, Any] = {**super().get_config(), "size": self.size, "output_dim": self.output_dim}
        return config


def with_kept_rows(model: Any, values: Mapping[str, Array], row_state: Mapping[str, Mapping[str, Array]]) -> Any:
    """The model to export: its HashEmbeddings replaced by KeyedTables of the rows the shards kept (`row_state`:
    a checkpoint's per-row state by variable, with the keys and last pushes: ps/keyed.py), every variable set from
    `values` (a checkpoint's whole variables by path). ValueError naming a variable the values lack."""
    kept: dict[str, tuple[Array, Array]] = {}
    for layer in _layers(model):
        if isinstance(layer, HashEmbedding):
            path = layer.embeddings.path
            state = row_state.get(path, {})
            if "keyed.keys" not in state or "keyed.touched" not in state or path not in values:
                raise ValueError(f"{path}: the checkpoint has no keys for this HashEmbedding")
            used = np.flatnonzero(state["keyed.touched"] >= 0)
            order = used[np.argsort(state["keyed.keys"][used], kind="stable")]
            kept[layer.name] = (np.asarray(state["keyed.keys"])[order], np.asarray(values[path])[order])

    def replace(layer: Any) -> Any:
        if layer.name in kept:
            return KeyedTable(kept[layer.name][0].size, layer.output_dim, name=layer.name, dtype=layer.dtype_policy)
        return layer.__class__.from_config(layer.get_config())

    out = keras.models.clone_model(model, clone_function=replace, recursive=True) if kept else model
    by_layer = {layer.name: layer for layer in _layers(out)}
    for name, (keys, rows) in kept.items():
        table = by_layer[name]
        if keys.size:
            table.keys.assign(keys)
            table.embeddings.assign(rows)
        else:
            table.keys.assign(np.full(1, PAD_ID, dtype=np.int64))
    tables = {by_layer[name].embeddings.path for name in kept}
    for variable in out.trainable_variables:
        if variable.path in tables:
            continue
        if variable.path not in values:
            raise ValueError(f"the checkpoint has no values for {variable.path}")
        variable.assign(values[variable.path])
    return out


def is_table(layer: Any) -> bool:
    """Whether a layer's table is read by rows: a Keras Embedding or a HashEmbedding."""
    return type(layer) in (keras.layers.Embedding, HashEmbedding)


def row_id_variables(model: Any) -> list[Any]:
    """The row ids of every local table of a model (LocalRows: state each step feeds, never the shards')."""
    return [layer.row_ids for layer in _layers(model) if isinstance(layer, LocalRows)]


def table_layers(model: Any) -> list[str]:
    """The names of a model's layers whose tables are read by rows (nested models' included)."""
    return [layer.name for layer in _layers(model) if is_table(layer)]


def has_keyed_table(model: Any) -> bool:
    """Whether a model has a HashEmbedding (a table that is only ever read by rows)."""
    return any(isinstance(layer, HashEmbedding) for layer in _layers(model))


@dataclass(frozen=True)
class RowTable:
    """One table read by rows: its variable's path, whole shape and dtype, the local table's capacity,
    how the shards can make it (None: from the values the chief sends) and where its ids come from."""

    variable: str
    shape: tuple[int, ...]
    dtype: str
    capacity: int
    init: RowInit | None
    layer: str
    keyed: bool = False  # a HashEmbedding's: rows by key (any int64), at most shape[0] kept


class SparseModel:
    """The user's model with its tables read by rows (see the module's docstring)."""

    def __init__(self, model: Any, tables: Sequence[RowTable], ids_fn: Callable[[Array], list[Array]]) -> None:
        self.model = model
        self.tables = tuple(tables)
        self._ids_fn = ids_fn
        by_layer = {layer.name: layer for layer in _layers(model)}
        #: the local tables' row ids: non-trainable variables each step feeds (worker.trainer.make_grad_fn)
        self.fed = [by_layer[t.layer].row_ids for t in self.tables]

    def specs(self) -> list[VariableSpec]:
        """Every trainable variable as placement must see it: tables at their whole shape."""
        whole = {t.variable: t for t in self.tables}
        return [VariableSpec(v.path, whole[v.path].shape, whole[v.path].dtype, whole[v.path].keyed)
                if v.path in whole else VariableSpec(v.path, tuple(v.shape), str(v.dtype))
                for v in self.model.trainable_variables]

    def batch_ids(self, x: Array) -> dict[str, IndexArray]:
        """The distinct ids (sorted) each table's rows a batch looks up; ValueError for an id outside a table
        (a keyed table takes any int64) or more distinct ids than its capacity."""
        out: dict[str, IndexArray] = {}
        for table, ids in zip(self.tables, self._ids_fn(x), strict=True):
            unique = np.unique(np.asarray(ids, dtype=np.int64))
            if not table.keyed and unique.size and (unique[0] < 0 or unique[-1] >= table.shape[0]):
                raise ValueError(f"{table.variable}: ids must lie in [0, {table.shape[0]}), got "
                                 f"{int(unique[0])}..{int(unique[-1])}")
            if unique.size > table.capacity:
                raise ValueError(f"{table.variable}: {unique.size} distinct ids in one batch, more than the "
                                 f"{table.capacity} rows its local table holds (a larger batch than the run's?)")
            out[table.variable] = unique
        return out

    def step(self, rows: Mapping[str, SparseRows]) -> RowStep:
        """One step over the rows served for a batch: the local tables and row ids filled."""
        return RowStep(self, rows)


class RowStep:
    """The local state of one step: each table's local rows (padded to capacity), and the mapping of the
    gradient back to rows of the whole table with the clocks they were read at."""

    def __init__(self, sparse: SparseModel, rows: Mapping[str, SparseRows]) -> None:
        self._sparse = sparse
        self._rows = rows
        self.tables: dict[str, Array] = {}
        self.fed: list[Array] = []  # each table's row ids, in SparseModel.fed's order
        for table in sparse.tables:
            read = rows[table.variable]
            local = aligned_zeros((table.capacity, *table.shape[1:]), table.dtype)
            local[:read.indices.size] = read.values
            ids = np.full(table.capacity, PAD_ID, dtype=np.int64)
            ids[:read.indices.size] = read.indices
            self.fed.append(ids)
            self.tables[table.variable] = local

    def whole(self, name: str, grad: Gradient) -> Gradient:
        """A gradient of the local table as rows of the whole table (others unchanged)."""
        read = self._rows.get(name)
        if read is None or not isinstance(grad, SparseRows):
            return grad
        held = grad.indices < read.indices.size  # a padded row is never looked up; kept out all the same
        local = grad.indices[held]
        clocks = read.clocks[local] if read.clocks is not None else None
        return SparseRows(read.indices[local], grad.values[held], clocks)


def _layers(model: Any) -> list[Any]:
    """Every layer of a model, nested models' included."""
    out = []
    for layer in model.layers:
        out.append(layer)
        if hasattr(layer, "layers"):
            out.extend(_layers(layer))
    return out


def _row_init(layer: Any, seed: int) -> RowInit | None:
    """The row initializer of an Embedding's table (None: one the shards cannot make)."""
    init = layer.embeddings_initializer
    config = init.get_config() if hasattr(init, "get_config") else {}
    own = config.get("seed")
    # an unseeded initializer: a seed of the run's, one per layer (every process derives the same)
    seed = int(own) if isinstance(own, int) else int.from_bytes(
        hashlib.sha256(f"{seed}/{layer.name}".encode()).digest()[:4], "big")
    kind = type(init).__name__
    if kind == "RandomUniform":
        return RowInit.parse(f"uniform:min={config['minval']},max={config['maxval']},seed={seed}")
    if kind in ("RandomNormal", "TruncatedNormal"):
        name = "normal" if kind == "RandomNormal" else "truncated_normal"
        return RowInit.parse(f"{name}:mean={config['mean']},stddev={config['stddev']},seed={seed}")
    if kind == "Zeros":
        return RowInit.parse("zeros")
    if kind == "Constant":
        return RowInit.parse(f"constant:value={float(config['value'])}")
    return None


def _capacity(layer: Any, batch_size: int) -> int:
    """The most distinct ids one batch can look up in a layer: its ids per example times the batch size,
    at most the table's rows (a keyed table's ids are any int64)."""
    shape = tuple(layer.input.shape[1:])
    if any(d is None for d in shape):
        raise _Unsupported(f"{layer.name} looks up a variable number of ids per example {shape}")
    per_batch = batch_size * math.prod(shape)
    return int(per_batch if isinstance(layer, HashEmbedding) else min(layer.input_dim, per_batch))


class _Unsupported(Exception):
    """Why a model's tables cannot be read by rows."""


def plan(model: Any, batch_size: int, seed: int = 0) -> SparseModel | None:
    """The model with its Embedding tables read by rows, or None when it has no Embedding; a model it
    cannot clone (subclassed, an Embedding with mask_zero, several inputs) is logged and None too, unless
    it has a HashEmbedding (read by rows only): then ValueError saying why."""
    embeddings = [layer for layer in _layers(model) if is_table(layer)]
    if not embeddings:
        return None
    try:
        return _clone(model, embeddings, batch_size, seed)
    except _Unsupported as why:
        if has_keyed_table(model):
            raise ValueError(f"the model's HashEmbedding tables live on the shards by key and are read by rows "
                             f"only, which this model does not allow: {why}") from None
        log.info("tables pulled whole: %s", why)
        return None


def _clone(model: Any, embeddings: list[Any], batch_size: int, seed: int) -> SparseModel:
    if len(model.inputs or []) != 1 or any(layer.mask_zero for layer in embeddings):
        raise _Unsupported("asyncps reads tables by rows for one-input models without mask_zero Embeddings")
    capacity = {layer.name: _capacity(layer, batch_size) for layer in embeddings}
    tables = [RowTable(layer.embeddings.path, (layer.input_dim, layer.output_dim), str(layer.embeddings.dtype),
                       capacity[layer.name], _row_init(layer, seed), layer.name, isinstance(layer, HashEmbedding))
              for layer in embeddings]
    unmade = [t.layer for t in tables if t.keyed and t.init is None]
    if unmade:
        raise _Unsupported(f"HashEmbedding {unmade}: the shards make a key's row from its initializer, which "
                           "must be uniform, normal, truncated normal, constant or zeros")

    def replace(layer: Any) -> Any:
        if layer.name in capacity:
            return LocalRows(capacity[layer.name], layer.output_dim, name=layer.name, dtype=layer.dtype_policy)
        return layer.__class__.from_config(layer.get_config())

    try:  # nested functional and sequential models (a saved model's wrapper) are cloned the same way
        clone = keras.models.clone_model(model, clone_function=replace, recursive=True)
    except (ValueError, TypeError, NotImplementedError) as exc:
        raise _Unsupported(f"the model cannot be cloned ({type(exc).__name__}: {exc})") from None
    paths = {v.path for v in clone.trainable_variables}
    by_layer = {layer.name: layer for layer in _layers(clone)}
    if any(t.variable not in paths or not isinstance(by_layer.get(t.layer), LocalRows) for t in tables):
        raise _Unsupported("the clone's tables do not keep their layers' names and paths")
    try:
        finders = [_ids_of(clone, by_layer[t.layer]) for t in tables]
    except ValueError as exc:  # a layer's input not reachable as a function of the model's input
        raise _Unsupported(f"the ids a table looks up cannot be computed from the model's input ({exc})") from None

    def ids_fn(x: Array) -> list[Array]:
        return [np.asarray(find([x])) for find in finders]

    return SparseModel(clone, tables, ids_fn)


def _ids_of(model: Any, target: Any) -> Callable[[list[Any]], Any]:
    """A function of the model's inputs (a list) giving the ids `target` (a layer of the model, maybe in a nested
    model, such as a model of several inputs behind its packed features) looks up: an input itself when the layer
    reads it, else the model's prefix up to the layer."""
    if target in model.layers:
        return _prefix(model, target)
    inner = next(layer for layer in model.layers if hasattr(layer, "layers") and target in _layers(layer))
    outer, rest = _inputs_of(model, inner), _ids_of(inner, target)
    return lambda xs: rest(outer(xs))


def _inbound(layer: Any) -> list[Any]:
    """The tensors `layer` is called on, in its model's graph; _Unsupported unless it is called once."""
    nodes = [node for node in layer._inbound_nodes if node.operation is layer]
    if len(nodes) != 1:
        raise _Unsupported(f"{layer.name} is called {len(nodes)} times")
    return list(nodes[0].input_tensors)  # in this model's graph (a nested model's `.input` is in its own)


def _inputs_of(model: Any, inner: Any) -> Callable[[list[Any]], list[Any]]:
    """The model's inputs → the inputs a nested model `inner` is called on (a list)."""
    tensors = _inbound(inner)
    if all(any(t is i for i in model.inputs) for t in tensors):
        where = [next(k for k, i in enumerate(model.inputs) if t is i) for t in tensors]
        return lambda xs: [xs[k] for k in where]
    prefix = keras.Model(model.inputs, tensors)
    return lambda xs: list(prefix(xs, training=False))


def _prefix(model: Any, layer: Any) -> Callable[[list[Any]], Any]:
    """The model's inputs → `layer`'s input (one of them when the layer reads it)."""
    tensors = _inbound(layer)
    if len(tensors) != 1:
        raise _Unsupported(f"{layer.name} is called on several inputs")
    for k, given in enumerate(model.inputs):
        if tensors[0] is given:
            return lambda xs: xs[k]
    prefix = keras.Model(model.inputs, tensors[0])
    return lambda xs: prefix(xs, training=False)


def build_deferred(build: Callable[[], Any]) -> Any:
    """The model `build` makes, its variables left uninitialized (no memory for its tables): initialize
    the ones kept with `initialize`, or drop the model. A builder that cannot run so (one that makes a
    variable from a value, e.g. a saved model compiled with its optimizer) builds as usual, tables made."""
    from keras.src.backend.common import global_state  # the collection StatelessScope initializes from

    before = list(global_state.get_global_attribute("uninitialized_variables") or [])
    try:
        with keras.StatelessScope(initialize_variables=False):
            return build()
    except ValueError as exc:
        if "stateless scope" not in str(exc):
            raise
        log.info("the model is built with its tables made: %s", str(exc).splitlines()[0])
    finally:
        # the scope registered the model's variables to be made at the next scope's exit (Keras' stateless
        # calls enter one every step): forget them, so a table is never made behind the worker's back
        global_state.set_global_attribute("uninitialized_variables", before)
    return build()


def initialize(model: Any) -> None:
    """Make every variable of a model built by build_deferred."""
    for variable in model.variables:
        if variable._value is None:
            variable._deferred_initialize()


__all__ = ["PAD_ID", "HashEmbedding", "KeyedTable", "LocalRows", "RowStep", "RowTable", "SparseModel",
           "build_deferred", "has_keyed_table", "initialize", "is_table", "plan", "row_id_variables", "table_layers",
           "with_kept_rows"]
