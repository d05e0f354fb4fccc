"""Keras model zoo shared by workers and the chief: flat float32 features (or int64 ids) in, logits (or targets) out.

Every layer has a fixed name and a seeded initializer so that every process builds a model
whose ``trainable_variables`` have identical paths, order, shapes and (for equal seeds) values;
the parameter server keys variables by path. No zoo model keeps non-trainable state; a user's model may
(BatchNormalization's moving statistics): the shards hold it beside the trainable variables
(state_variables, shard_variables).
"""

from __future__ import annotations

import math
import zipfile
from typing import Any

import keras
import numpy as np
import tensorflow as tf

# the model specs accepted by build_model (mlp:H1,H2,... picks hidden sizes) are checked there
from asyncps.ml.specs import KERAS_PREFIX, MODEL_NAMES, RECSYS, parse_hidden, parse_recsys_model
from asyncps.ml.userfns import call_with_accepted, is_function_spec, load_function

#: Quantization levels per feature for the embedding model's tokenizer (features in [0, 1]).
#: 8 rather than 16: on digits finer levels make rarer tokens and overfit (0.93 vs 0.94 test).
EMBEDDING_LEVELS = 8
EMBEDDING_DIM = 16
EMBEDDING_HEAD_HIDDEN = 64
#: The recsys model's hidden layer over its flattened id embeddings.
RECSYS_HIDDEN = 64


def build_model(
    spec: str,
    num_features: int,
    num_classes: int,
    image_shape: tuple[int, ...] | None = None,
    seed: int = 0,
    targets: tuple[int, ...] | None = None,
    id_rows: int = 0,
) -> keras.Model:
    """Build the model named by ``spec`` with weights created and seeded from ``seed``.

    ``targets``: the shape of one example's label when the labels are not class ids (regression,
    multi-label), else None; then ``num_classes`` is the target width and the built-in models output
    that many values. ``id_rows``: the id space of int64 features (Dataset.id_rows), the rows of the
    ``recsys`` model's table unless its spec names them.
    """
    if num_features < 1:
        raise ValueError(f"num_features must be >= 1, got {num_features}")
    if num_classes < (2 if targets is None else 1):
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    if spec.startswith(KERAS_PREFIX):
        return build_saved_model(spec, num_features, num_classes, targets)
    if is_function_spec(spec, MODEL_NAMES):
        return build_user_model(spec, num_features, num_classes, image_shape, seed, targets)
    name, _, arg = spec.partition(":")
    init = _Initializers(seed)
    if name == RECSYS:
        return _recsys(spec, num_features, num_classes, id_rows, init)
    inputs = keras.Input(shape=(num_features,), dtype="float32", name="features")
    if name == "logreg" and not arg:
        logits = _dense(num_classes, "logits", init)(inputs)
    elif name == "mlp":
        logits = _mlp(inputs, parse_hidden(arg, spec), num_classes, init)
    elif name == "cnn" and not arg:
        logits = _cnn(inputs, num_features, num_classes, image_shape, init)
    elif name == "embedding" and not arg:
        logits = _embedding(inputs, num_features, num_classes, init)
    else:
        raise ValueError(
            f"unknown model spec {spec!r}; valid: {', '.join(MODEL_NAMES)}, mlp:H1,H2,..., package.module:function"
        )
    # A functional model is built (all variables created) as soon as it is constructed.
    return keras.Model(inputs=inputs, outputs=logits, name=name)


def build_user_model(
    spec: str, num_features: int, num_classes: int, image_shape: tuple[int, ...] | None, seed: int,
    targets: tuple[int, ...] | None = None,
) -> keras.Model:
    """The Keras model a `package.module:function` spec returns, taking flat features like the zoo's.

    The function is called with those of `input_shape` (the dataset's image layout, else
    `(num_features,)`), `num_classes` (the target width for labels that are not class ids),
    `output_shape` (`(num_classes,)`, or one example's label shape) and `seed` it accepts. The model is
    wrapped so that it reads the flat features every role feeds (reshaped to `input_shape`; its Input's dtype),
    compiled with the loss and metrics the builder compiled it with (asyncps.ml.task: the run's loss
    `auto`). Its non-trainable state but random generators' (BatchNormalization's moving statistics) lives
    on the shards beside its trainable variables: each push carries its delta (state_variables).
    """
    input_shape = tuple(image_shape) if image_shape is not None else (num_features,)
    output_shape = (num_classes,) if targets is None else (targets or (1,))
    user = call_with_accepted(load_function(spec, "model"), input_shape=input_shape, num_classes=num_classes,
                              output_shape=output_shape, seed=seed)
    if not isinstance(user, keras.Model):
        raise ValueError(f"model {spec!r} must return a keras.Model, got {type(user).__name__}")
    model = _flat_input_model(user, spec, num_features, input_shape)
    _compile_like(model, spec, user.get_compile_config() if user.compiled else None, user)
    width = tuple(model.outputs[0].shape[1:])
    if targets is None and width != (num_classes,):
        raise ValueError(f"model {spec!r} outputs shape {width}, not ({num_classes},) (one score per class)")
    return model


def _compile_like(model: keras.Model, spec: str, config: dict[str, Any] | None, user: keras.Model) -> None:
    """Compile the wrapper with the loss and metrics of the user's compile `config` (its optimizer is not
    used: the shards apply the run's); nothing when the user's model was not compiled. A model of several
    outputs needs a loss per output (asyncps.ml.heads)."""
    if len(_outputs_of(user)) > 1:
        from asyncps.ml.heads import compile_per_output

        try:
            compile_per_output(model, user, config)
        except (TypeError, ValueError) as error:
            raise ValueError(f"model {spec!r}: {error}") from None
        return
    if not config or config.get("loss") is None:
        return
    try:
        loss = keras.saving.deserialize_keras_object(config["loss"])
        metrics = keras.saving.deserialize_keras_object(config.get("metrics"))
    except (TypeError, ValueError) as error:  # an unregistered custom loss or metric
        raise ValueError(f"model {spec!r} was compiled with a loss or metrics that cannot be loaded here: {error} "
                         "(register custom objects with keras.saving.register_keras_serializable in a module on "
                         "--user-path, or pass --loss/--eval-metrics)") from None
    model.compile(loss=loss, metrics=metrics)


def build_saved_model(spec: str, num_features: int, num_classes: int,
                      targets: tuple[int, ...] | None = None) -> keras.Model:
    """The model a `keras:PATH.keras` spec names (saved with `model.save`), its saved weights the start.

    Every process loads the same file, so layer names, variable paths, order and values agree. The
    model takes the flat features every role feeds (in its Input's dtype), reshaped to the saved model's own input
    shape. Custom layers, losses or activations must be registered with Keras
    (`keras.saving.register_keras_serializable`) in an importable module (on --user-path): each process
    imports the modules the file names for registered objects before loading it.
    Its output may have more scores than the data has classes (labels need not cover every class).
    Saved compiled, its loss and metrics come with it (the wrapper is compiled with them).
    """
    path = spec[len(KERAS_PREFIX):]
    try:
        import_registered_modules(path)
        user = keras.saving.load_model(path, compile=False)
    except (OSError, ValueError, TypeError, KeyError, zipfile.BadZipFile) as error:  # not a .keras, unregistered object
        raise ValueError(f"model {spec!r} cannot be loaded: {error} (register custom objects with "
                         "keras.saving.register_keras_serializable in a module on --user-path)") from None
    input_shape = tuple(user.inputs[0].shape[1:])
    if len(user.inputs) == 1 and (any(d is None for d in input_shape) or math.prod(input_shape) != num_features):
        raise ValueError(f"model {spec!r} takes inputs of shape {input_shape}, which do not hold the data's "
                         f"{num_features} features per example")
    model = _flat_input_model(user, spec, num_features, input_shape)
    _compile_like(model, spec, _saved_compile_config(path), user)
    width = tuple(model.outputs[0].shape[1:])
    if targets is None and (len(width) != 1 or width[0] is None or width[0] < num_classes):
        raise ValueError(f"model {spec!r} outputs shape {width}: it needs one score per class "
                         f"(at least {num_classes})")
    return model


def _saved_compile_config(path: str) -> dict[str, Any] | None:
    """The compile config a .keras file was saved with (None: saved uncompiled)."""
    import json

    from keras.src.saving import saving_lib  # the archive's own file names are Keras' (not a run directory's)

    with zipfile.ZipFile(path) as archive:
        config = json.loads(archive.read(saving_lib._CONFIG_FILENAME))
    compiled = config.get("compile_config")
    return compiled if isinstance(compiled, dict) else None


def import_registered_modules(path: str) -> list[str]:
    """Import the modules a .keras file names for registered custom objects (not Keras' own), so that
    their `register_keras_serializable` decorators run in this process; return those imported."""
    import importlib
    import json

    from keras.src.saving import saving_lib  # the archive's own file names are Keras' (not a run directory's)

    with zipfile.ZipFile(path) as archive:
        config = json.loads(archive.read(saving_lib._CONFIG_FILENAME))
    modules: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            module = node.get("module")
            if node.get("registered_name") and isinstance(module, str) and module.split(".")[0] not in (
                    "keras", "builtins", "__main__"):
                modules.add(module)
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(config)
    for module in sorted(modules):
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise ValueError(f"{path} uses custom objects of module {module!r}, which does not import ({error}); "
                             "put its directory on --user-path") from None
    return sorted(modules)


#: The name Keras gives a random generator's state variable (keras.random.SeedGenerator).
RANDOM_STATE_NAME = "seed_generator_state"


def is_random_state(variable: Any) -> bool:
    """Whether a variable is a random generator's state (Dropout's): local to each worker, never on a shard."""
    return bool(variable.path.split("/")[-1] == RANDOM_STATE_NAME)


def state_variables(model: Any, fed: Any = ()) -> list[Any]:
    """The model's non-trainable state the shards hold beside its trainable variables (BatchNormalization's
    moving statistics): every non-trainable variable but random generators' state and the `fed` ones (a
    local table's row ids, asyncps.ml.sparse). A worker's step reads them with its pull and pushes each
    one's delta, new value minus the value read, which the shard adds (UpdateRuleConfig.state)."""
    from asyncps.ml.sparse import row_id_variables

    skip = {v.path for v in [*fed, *row_id_variables(model)]}  # a local table's row ids are the worker's own
    return [v for v in model.non_trainable_variables if not is_random_state(v) and v.path not in skip]


def shard_variables(model: Any) -> list[Any]:
    """The variables the shards hold, in order: the trainable ones, then the state (state_variables)."""
    return [*model.trainable_variables, *state_variables(model)]


def seed_random_state(model: Any, seed: int, worker: int) -> int:
    """Seed every random generator of `model` from the run's seed and the worker's index, so each worker
    draws its own dropout masks and a run is reproducible; the number of generators seeded."""
    generators = [v for v in model.non_trainable_variables if is_random_state(v)]
    for i, variable in enumerate(generators):
        mixed = (seed * 1_000_003 + worker * 7919 + i) % (2**32 - 1)
        variable.assign(np.array([mixed, 0], dtype=variable.dtype))
    return len(generators)


def _flat_input_model(user: keras.Model, spec: str, num_features: int, input_shape: tuple[int, ...]) -> keras.Model:
    """`user` behind an input of flat features of its own input dtype (float32, or integer ids kept exact),
    reshaped to `input_shape`; checks its state.

    Random generators' state (Dropout's, noise layers') is each worker's own (seeded per worker:
    seed_random_state); other non-trainable state (BatchNormalization's moving statistics) lives on the
    shards beside the trainable variables (state_variables). Variable paths must be unique: the shards key
    variables by path.
    """
    if len(_inputs_of(user)) > 1:
        inputs, x = _packed_inputs(user, spec, num_features)
    else:
        inputs = keras.Input(shape=(num_features,), dtype=_input_dtype(user), name="features")
        x = inputs if input_shape == (num_features,) else keras.layers.Reshape(input_shape, name="to_input")(inputs)
    try:
        outputs = user(x)
    except Exception as error:  # the user's model cannot take this input: say which one it got
        raise ValueError(f"model {spec!r} cannot take inputs of shape {input_shape}: {error}") from None
    if isinstance(outputs, (list, tuple, dict)) and len(outputs) > 1:  # one output of them all (asyncps.ml.heads)
        heads = list(outputs.values()) if isinstance(outputs, dict) else list(outputs)
        flat = [keras.layers.Reshape((-1,), name=f"flat_output_{i}")(o) for i, o in enumerate(heads)]
        outputs = keras.layers.Concatenate(name="outputs")(flat)
    model = keras.Model(inputs=inputs, outputs=outputs, name="user_model")
    state = state_variables(model)
    bad = [f"{v.path} ({v.dtype})" for v in state if "float" not in str(v.dtype)]
    if bad:
        raise ValueError(f"model {spec!r} has non-trainable state that is not floating point {bad[:4]}: the "
                         "shards add deltas to it; keep such state out of the model")
    paths = [v.path for v in shard_variables(model)]
    if len(set(paths)) != len(paths):
        raise ValueError(f"model {spec!r}: variable paths are not unique ({paths}); give the layers distinct names")
    return model


def _inputs_of(user: keras.Model) -> list[Any]:
    """The user's model's Inputs ([] for a Sequential not built on an Input)."""
    try:
        return list(user.inputs or [])
    except (AttributeError, ValueError):
        return []


def _outputs_of(user: keras.Model) -> list[Any]:
    """The user's model's outputs ([] for a Sequential not built on an Input)."""
    try:
        return list(user.outputs or [])
    except (AttributeError, ValueError):
        return []


def _packed_inputs(user: keras.Model, spec: str, num_features: int) -> tuple[Any, list[Any]]:
    """An input of packed features for a model of several inputs, and its slices, one per input in order
    (asyncps.ml.multiio); ValueError when the data's features are not as many as the inputs take together."""
    from asyncps.ml.multiio import input_specs, packed_dtype

    specs = input_specs(user)
    width = sum(s.width for s in specs)
    if width != num_features:
        raise ValueError(f"model {spec!r} has inputs {[(s.name, s.shape) for s in specs]}, {width} values per "
                         f"example packed, but the data has {num_features} features (pack them with "
                         "asyncps.ml.multiio.pack)")
    inputs = keras.Input(shape=(num_features,), dtype=np.dtype(packed_dtype(specs)).name, name="features")
    slices, start = [], 0
    for i, s in enumerate(specs):
        slices.append(InputSlice(start, s.shape, s.dtype, name=f"input_{i}")(inputs))
        start += s.width
    return inputs, slices


@keras.saving.register_keras_serializable(package="asyncps")
class InputSlice(keras.layers.Layer):  # type: ignore[misc]  # keras is untyped
    """One input of a model of several inputs, out of the packed features: the values from `start` on, as many
    as `shape` holds, reshaped to it and cast to `dtype` (asyncps.ml.multiio: ids packed as float32 are exact)."""

    def __init__(self, start: int, shape: tuple[int, ...], dtype_out: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.start, self.slice_shape, self.dtype_out = int(start), tuple(int(d) for d in shape), str(dtype_out)

    def call(self, inputs: Any) -> Any:
        """[batch, packed] -> [batch, *shape] in dtype_out."""
        values = inputs[:, self.start:self.start + math.prod(self.slice_shape)]
        if "int" in self.dtype_out and "float" in str(values.dtype):
            values = keras.ops.round(values)
        return keras.ops.cast(keras.ops.reshape(values, (-1, *self.slice_shape)), self.dtype_out)

    def compute_output_spec(self, inputs: Any) -> keras.KerasTensor:
        """Symbolic [batch, *shape] output in dtype_out."""
        return keras.KerasTensor((inputs.shape[0], *self.slice_shape), dtype=self.dtype_out)

    def get_config(self) -> dict[str, Any]:
        """Serializable config."""
        config: dict[str, Any] = super().get_config()
        config.update(start=self.start, shape=list(self.slice_shape), dtype_out=self.dtype_out)
        return config


def _input_dtype(user: keras.Model) -> str:
    """The dtype `user` reads (an int64 Input reads ids); float32 for a model with no Input of its own yet."""
    try:
        return str(user.inputs[0].dtype)
    except (AttributeError, ValueError, IndexError, TypeError):  # a Sequential built on its first call
        return "float32"


def loss_fn(logits: Any, labels: Any, weights: Any = None) -> tf.Tensor:
    """Mean sparse categorical cross-entropy of integer ``labels`` under ``logits``; with ``weights`` (one per
    example) the weighted sum over the batch size, as Keras reduces a weighted loss (sum_over_batch_size)."""
    labels = tf.cast(tf.reshape(labels, [-1]), tf.int64)
    logits = tf.cast(logits, tf.float32)
    per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    return tf.reduce_mean(per_example) if weights is None else weighted_mean(per_example, weights)


def weighted_mean(per_example: Any, weights: Any) -> tf.Tensor:
    """sum(weights * losses) / examples: Keras' reduction of a weighted loss; losses of any rank per example
    are first averaged over their other axes."""
    per_example = tf.cast(per_example, tf.float32)
    if per_example.shape.rank is not None and per_example.shape.rank > 1:
        per_example = tf.reduce_mean(per_example, axis=list(range(1, per_example.shape.rank)))
    weights = tf.cast(tf.reshape(weights, [-1]), tf.float32)
    return tf.reduce_sum(per_example * weights) / tf.cast(tf.size(weights), tf.float32)


class _Initializers:
    """Hands out initializers with distinct, deterministic seeds derived from one model seed."""

    def __init__(self, seed: int) -> None:
        self._seed = seed
        self._count = 0

    def _next_seed(self) -> int:
        # Distinct per layer: two same-shaped layers sharing an int seed would start identical.
        self._count += 1
        return (self._seed * 1_000_003 + self._count) % (2**31 - 1)

    def glorot(self) -> keras.initializers.Initializer:
        """Glorot-uniform kernel initializer with the next seed."""
        return keras.initializers.GlorotUniform(seed=self._next_seed())

    def he(self) -> keras.initializers.Initializer:
        """He-uniform initializer for ReLU layers, with the next seed."""
        return keras.initializers.HeUniform(seed=self._next_seed())

    def uniform(self, limit: float) -> keras.initializers.Initializer:
        """Uniform(-limit, limit) initializer with the next seed."""
        return keras.initializers.RandomUniform(-limit, limit, seed=self._next_seed())


def _dense(
    units: int, name: str, init: _Initializers, activation: str | None = None
) -> keras.layers.Dense:
    """A Dense layer with a fixed name, a seeded kernel and zero bias."""
    kernel = init.he() if activation == "relu" else init.glorot()
    return keras.layers.Dense(
        units, activation=activation, kernel_initializer=kernel, bias_initializer="zeros", name=name
    )


def _mlp(inputs: Any, hidden: tuple[int, ...], num_classes: int, init: _Initializers) -> Any:
    """ReLU multilayer perceptron."""
    x = inputs
    for i, units in enumerate(hidden):
        x = _dense(units, f"hidden_{i}", init, activation="relu")(x)
    return _dense(num_classes, "logits", init)(x)


def _cnn(
    inputs: Any,
    num_features: int,
    num_classes: int,
    image_shape: tuple[int, ...] | None,
    init: _Initializers,
) -> Any:
    """Two conv/pool stages and a linear head over the reshaped image."""
    if image_shape is None:
        raise ValueError("the cnn model needs an image_shape (dataset has no image layout)")
    if len(image_shape) == 2:
        image_shape = (*image_shape, 1)
    if len(image_shape) != 3 or math.prod(image_shape) != num_features:
        raise ValueError(f"image_shape {image_shape} does not match {num_features} features")
    x = keras.layers.Reshape(image_shape, name="to_image")(inputs)
    for i, filters in enumerate((16, 32)):
        x = keras.layers.Conv2D(
            filters,
            3,
            padding="same",
            activation="relu",
            kernel_initializer=init.he(),
            bias_initializer="zeros",
            name=f"conv_{i}",
        )(x)
        # padding="same" so that tiny images (digits are 8x8) survive two poolings.
        x = keras.layers.MaxPooling2D(2, padding="same", name=f"pool_{i}")(x)
    x = keras.layers.Flatten(name="flatten")(x)
    return _dense(num_classes, "logits", init)(x)


class QuantizeTokens(keras.layers.Layer):  # type: ignore[misc]  # keras is untyped
    """Maps features in [0, 1] to token ids ``feature_index * levels + level``."""

    def __init__(self, levels: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.levels = levels

    def call(self, inputs: Any) -> Any:
        """Quantize each feature into ``levels`` bins (clipped) and offset by its position."""
        x = keras.ops.convert_to_tensor(inputs, dtype="float32")
        level = keras.ops.clip(keras.ops.floor(x * self.levels), 0, self.levels - 1)
        level = keras.ops.cast(level, "int32")
        offsets = keras.ops.arange(keras.ops.shape(x)[-1], dtype="int32") * self.levels
        return level + offsets

    def compute_output_spec(self, inputs: Any) -> keras.KerasTensor:
        """Symbolic int32 output of the input's shape."""
        return keras.KerasTensor(inputs.shape, dtype="int32")

    def get_config(self) -> dict[str, Any]:
        """Serializable config."""
        config: dict[str, Any] = super().get_config()
        config["levels"] = self.levels
        return config


class ScaledSumPool(keras.layers.Layer):  # type: ignore[misc]  # keras is untyped
    """Sums token embeddings over the sequence axis and divides by sqrt(sequence length)."""

    def call(self, inputs: Any) -> Any:
        """[batch, tokens, dim] -> [batch, dim]."""
        # A plain mean scales every embedding row's gradient by 1/tokens (1/64 on digits), which
        # leaves plain SGD at lr 0.1 stuck near 30% accuracy; 1/sqrt keeps pooled activations
        # O(1) for random embeddings while giving the sparse rows a usable gradient.
        num_tokens = keras.ops.cast(keras.ops.shape(inputs)[1], inputs.dtype)
        return keras.ops.sum(inputs, axis=1) / keras.ops.sqrt(num_tokens)

    def compute_output_spec(self, inputs: Any) -> keras.KerasTensor:
        """Symbolic [batch, dim] output."""
        return keras.KerasTensor((inputs.shape[0], inputs.shape[2]), dtype=inputs.dtype)


def _embedding(inputs: Any, num_features: int, num_classes: int, init: _Initializers) -> Any:
    """Per-(feature, level) token embeddings, sum-pooled, with a small ReLU head.

    The Embedding lookup is a gather, so its gradient is a sparse ``tf.IndexedSlices``.
    """
    tokens = QuantizeTokens(EMBEDDING_LEVELS, name="tokenize")(inputs)
    x = keras.layers.Embedding(
        num_features * EMBEDDING_LEVELS,
        EMBEDDING_DIM,
        embeddings_initializer=init.uniform(0.05),
        name="token_embedding",
    )(tokens)
    x = ScaledSumPool(name="pool")(x)
    x = _dense(EMBEDDING_HEAD_HIDDEN, "head_hidden", init, activation="relu")(x)
    return _dense(num_classes, "logits", init)(x)


def _recsys(spec: str, num_features: int, num_classes: int, id_rows: int, init: _Initializers) -> keras.Model:
    """`recsys[:rows=R,dim=D]`: int64 ids -> ONE shared id table (Embedding) -> Flatten -> ReLU -> logits.

    The table's rows are the spec's, else the data's id space (`id_rows`); fewer rows than the data's ids would
    fail inside a lookup, so that is refused here. Its gradient is sparse (the touched rows).
    """
    cfg = parse_recsys_model(spec)
    rows = cfg.rows or id_rows
    if rows < 1:
        raise ValueError(f"model {spec!r} needs rows=R, or a dataset of int64 ids (e.g. recsys:rows=R) to "
                         "take them from")
    inputs = keras.Input(shape=(num_features,), dtype="int64", name="ids")
    if cfg.keyed:  # rows by key on the shards, at most `rows` kept (fewer than the ids: the least recent give way)
        from asyncps.ml.sparse import HashEmbedding

        table = HashEmbedding(rows, cfg.dim, embeddings_initializer=init.uniform(0.05), name="id_embedding")
    elif rows < id_rows:
        raise ValueError(f"model {spec!r} has {rows} rows but the data's ids need {id_rows}")
    else:
        table = keras.layers.Embedding(rows, cfg.dim, embeddings_initializer=init.uniform(0.05), name="id_embedding")
    x = table(inputs)
    x = keras.layers.Flatten(name="flatten")(x)
    x = _dense(RECSYS_HIDDEN, "hidden", init, activation="relu")(x)
    return keras.Model(inputs=inputs, outputs=_dense(num_classes, "logits", init)(x), name=RECSYS)
