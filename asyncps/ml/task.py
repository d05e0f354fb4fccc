"""What a run trains for: its loss, the metrics the chief measures, and whether accuracy means anything.

Every process resolves the run's `loss` and `metrics` settings against the model it built and the data
it loaded, the same way: `auto` (the default loss) is the loss the model was compiled with (a
`package.module:function` builder that returns a compiled model, a `keras:` file saved compiled, the
model object handed to `asyncps.train`), else `crossentropy` of logits over integer class ids, the
built-in models' loss. An empty `metrics` setting means the model's compiled metrics (none when it was
not compiled).

Accuracy is measured only for a classification task: integer class ids [n] against a multi-class
output (the share of argmax hits), or when the metrics name it (`accuracy`, `binary_accuracy`, ...:
its value). Anything else (regression, multi-label without an accuracy metric) reports the loss and
the metrics, and accuracy NaN.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncps.ml.multiio import PER_OUTPUT_LOSS
from asyncps.ml.userfns import is_function_spec, load_function

log = logging.getLogger(__name__)

#: The loss setting that takes the model's compiled loss, else :data:`DEFAULT_LOSS`.
AUTO_LOSS = "auto"
#: The built-in models' loss: mean sparse categorical cross-entropy of logits (asyncps.ml.models.loss_fn).
DEFAULT_LOSS = "crossentropy"
#: Metric names that mean "accuracy, as the task defines it" (as Keras' compile resolves them).
ACCURACY_NAMES = ("accuracy", "acc")

LossFn = Callable[..., Any]  # (outputs, labels[, weights]) -> mean


@dataclass(frozen=True)
class Task:
    """The run's loss `(outputs, labels) -> mean`, its metrics by name and how accuracy is measured."""

    loss: LossFn
    loss_name: str
    from_logits: bool  # the loss reads its predictions as logits
    #: name -> a Keras metric function `(y_true, y_pred) -> per-example or mean values`, or a stateful
    #: keras.metrics.Metric (update_state per batch, result at the end)
    metrics: Mapping[str, Any] = field(default_factory=dict)
    #: "argmax": argmax of the outputs against integer class ids; the name of the metric that is the
    #: accuracy; None: not a classification task (accuracy is NaN)
    accuracy: str | None = None


def is_class_ids(y: np.ndarray) -> bool:
    """True for labels that are integer class ids, one per example ([n])."""
    return y.ndim == 1 and np.issubdtype(y.dtype, np.integer)


def resolve_loss(spec: str, model: Any) -> tuple[LossFn, str, bool]:
    """(loss, its name, whether it reads logits) for the `loss` setting and the built model."""
    from asyncps.ml.models import loss_fn  # here: `import asyncps.ml.task` loads no TensorFlow

    compiled = getattr(model, "loss", None) if spec == AUTO_LOSS else None
    if spec == AUTO_LOSS and compiled is None:
        spec = DEFAULT_LOSS
    if spec == DEFAULT_LOSS:
        return loss_fn, DEFAULT_LOSS, True
    if compiled is not None:
        user, name = _keras_loss(compiled, "the model's compiled loss")
    elif is_function_spec(spec):
        user, name = load_function(spec, "loss"), spec
    else:
        user, name = _keras_loss(spec, "loss")
    return _mean_loss(user), name, _reads_logits(user)


def make_loss(spec: str, model: Any = None) -> LossFn:
    """The loss `(outputs, labels) -> mean` a `loss` setting names for `model` (see resolve_loss)."""
    return resolve_loss(spec, model)[0]


def _keras_loss(loss: Any, what: str) -> tuple[Any, str]:
    """A Keras loss (a name, a function or a Loss object) as a callable, and its name."""
    import keras

    try:
        fn = keras.losses.get(loss) if isinstance(loss, str) else loss
    except ValueError:
        fn = None
    if fn is None or not callable(fn):
        raise ValueError(f"unknown {what} {loss!r}: {AUTO_LOSS}, {DEFAULT_LOSS}, a Keras loss name or "
                         "package.module:function")
    name = loss if isinstance(loss, str) else getattr(fn, "name", None) or getattr(fn, "__name__", repr(fn))
    return fn, str(name)


def _reads_logits(loss: Any) -> bool:
    """True when a Keras loss object was made with from_logits=True (a function or a name: Keras' default, no)."""
    get_config = getattr(loss, "get_config", None)
    if get_config is None:
        return False
    try:
        return bool(get_config().get("from_logits", False))
    except (NotImplementedError, TypeError):
        return False


def _mean_loss(user: Any) -> LossFn:
    """`(outputs, labels[, weights]) -> mean` over a Keras-style `(y_true, y_pred)` loss; labels as the data
    holds them; weights (one per example) reduced as Keras reduces them (asyncps.ml.models.weighted_mean)."""
    import keras
    import tensorflow as tf

    from asyncps.ml.models import weighted_mean

    def loss(outputs: Any, labels: Any, weights: Any = None) -> Any:
        rank = outputs.shape.rank
        if rank is not None and labels.shape.rank == rank - 1 and outputs.shape[-1] == 1:
            # targets [n] against outputs [n, 1]: a loss of its own may not align them, and
            # [n] - [n, 1] would broadcast to [n, n] without a word
            labels = tf.expand_dims(labels, -1)
        if weights is None:
            return tf.reduce_mean(tf.cast(user(labels, outputs), tf.float32))
        if isinstance(user, keras.losses.Loss):  # it reduces itself: hand it the weights, as fit does
            return tf.cast(user(labels, outputs, sample_weight=weights), tf.float32)
        value = user(labels, outputs)
        if value.shape.rank == 0:
            raise ValueError(f"loss {getattr(user, '__name__', user)!r} returns one value per batch: sample or "
                             "class weights need a loss per example")
        return weighted_mean(value, weights)

    return loss


def resolve_metrics(spec: str, model: Any) -> dict[str, Any]:
    """The metrics of the `metrics` setting (comma-separated names or `package.module:function`), or of the
    model's compile when the setting is empty; "accuracy"/"acc" stay names (see :func:`resolve_task`)."""
    if spec.strip():
        return make_metrics(spec)
    import keras

    compiled = _compiled_metrics(model)
    metrics: dict[str, Any] = {}
    for entry in compiled:
        if isinstance(entry, str):
            metrics.update(make_metrics(entry))
        elif isinstance(entry, keras.metrics.Metric):
            metrics[entry.name] = entry
        elif callable(entry):
            metrics[getattr(entry, "__name__", repr(entry))] = entry
        else:
            raise ValueError(f"the model's compiled metric {entry!r} is not supported: asyncps measures a "
                             "list of metrics for one output (pass --eval-metrics)")
    return metrics


def _compiled_metrics(model: Any) -> list[Any]:
    """The `metrics` the model was compiled with, as objects (a flat list), [] when not compiled."""
    import keras

    get_config = getattr(model, "get_compile_config", None)
    config = get_config() if get_config is not None else None
    if not config or not config.get("metrics"):
        return []
    metrics = keras.saving.deserialize_keras_object(config["metrics"])
    if isinstance(metrics, dict) or (isinstance(metrics, (list, tuple)) and any(
            isinstance(m, (list, tuple, dict)) for m in metrics)):
        raise ValueError(f"the model's compiled metrics {config['metrics']!r} are per output: asyncps trains "
                         "models with one output (pass --eval-metrics)")
    return list(metrics) if isinstance(metrics, (list, tuple)) else [metrics]


def make_metrics(spec: str) -> dict[str, Any]:
    """The metrics `{name: fn or Metric}` of a comma-separated spec: names of Keras metric functions
    (`sparse_top_k_categorical_accuracy`) or of Keras metrics (`mae`, `auc`), `accuracy`, or
    `package.module:function` taking `(y_true, y_pred)`; "" gives none."""
    import keras

    metrics: dict[str, Any] = {}
    for name in (part.strip() for part in spec.split(",")):
        if not name:
            continue
        if is_function_spec(name):
            metrics[name] = load_function(name, "metric")
            continue
        if name in ACCURACY_NAMES:
            metrics[name] = name  # which accuracy depends on the labels and the loss: resolve_task picks it
            continue
        fn = getattr(keras.metrics, name, None)
        if fn is not None and callable(fn) and not isinstance(fn, type):
            metrics[name] = fn
            continue
        try:
            metrics[name] = keras.metrics.get(name)
        except ValueError:
            raise ValueError(f"unknown metric {name!r}: the name of a Keras metric (e.g. mae, auc, "
                             "sparse_top_k_categorical_accuracy) or package.module:function") from None
    return metrics


def resolve_task(loss: str, metrics: str, model: Any, y: np.ndarray) -> Task:
    """The run's task for the model and labels `y` (the test labels: what the chief evaluates on)."""
    import keras

    loss_fn, loss_name, from_logits = resolve_loss(loss, model)
    if loss_name == DEFAULT_LOSS and not is_class_ids(y):
        raise ValueError(f"the loss {DEFAULT_LOSS} (of logits, over integer class ids) does not fit labels "
                         f"{y.dtype} of shape {tuple(y.shape[1:])} per example: pass a loss for them (e.g. --loss "
                         "mean_squared_error, binary_crossentropy) or compile the model with one")
    measured = resolve_metrics(metrics, model)
    outputs = tuple(model.outputs[0].shape[1:]) if len(model.outputs) == 1 else ()
    multiclass = len(outputs) == 1 and outputs[0] is not None and outputs[0] >= 2
    for name, fn in measured.items():
        if fn in ACCURACY_NAMES:  # Keras' compile picks the accuracy the same way
            if is_class_ids(y):
                measured[name] = keras.metrics.sparse_categorical_accuracy
            elif "categorical" in loss_name and "sparse" not in loss_name:
                measured[name] = keras.metrics.categorical_accuracy
            else:
                measured[name] = _binary_accuracy(0.0 if from_logits else 0.5)
    accuracy: str | None = None
    if is_class_ids(y) and multiclass:
        accuracy = "argmax"
    else:
        accuracy = next((name for name in measured if name.split(":")[-1].endswith(("accuracy", "acc"))), None)
    return Task(loss_fn, loss_name, from_logits, measured, accuracy)


def _binary_accuracy(threshold: float) -> Callable[[Any, Any], Any]:
    """Keras' binary accuracy at `threshold` (0 for logits: a logit above 0 is a probability above 0.5)."""
    import keras

    def binary_accuracy(y_true: Any, y_pred: Any) -> Any:
        return keras.metrics.binary_accuracy(y_true, y_pred, threshold=threshold)

    return binary_accuracy


def output_activation(model: Any) -> str | None:
    """The activation of the model's last layer (looking into nested models), e.g. softmax; None if none."""
    layer = model
    while hasattr(layer, "layers") and layer.layers:
        layer = layer.layers[-1]
    activation = getattr(layer, "activation", None)
    name = getattr(activation, "__name__", None)
    return str(name) if name else None


def logits_mismatch(model: Any, task: Task) -> str | None:
    """A warning when a softmax/sigmoid output meets a loss that reads logits (None: they agree)."""
    activation = output_activation(model)
    if task.from_logits and activation in ("softmax", "sigmoid"):
        return (f"the model's output layer applies {activation}, but the loss {task.loss_name!r} takes logits "
                f"(from_logits=True): it applies {activation} a second time and trains badly; drop the output's "
                f"activation, or use a loss for probabilities (e.g. --loss sparse_categorical_crossentropy, "
                "binary_crossentropy)")
    return None


def check_loss(task: Task, model: Any, x: np.ndarray, y: np.ndarray) -> None:
    """Evaluate the loss on two examples: a ValueError naming the shapes when labels and outputs do not fit."""
    import tensorflow as tf

    outputs = model(x[:2], training=False)
    labels, produced = tuple(y.shape[1:]) or (1,), tuple(outputs.shape[1:])
    if not is_class_ids(y) and not is_function_spec(task.loss_name) and task.loss_name != PER_OUTPUT_LOSS and (
            labels != produced):
        # Keras' losses broadcast mismatched targets and outputs without a word ([n, 4] against [n, 1])
        raise ValueError(f"loss {task.loss_name!r} cannot compare labels {y.dtype} {tuple(y.shape[1:])} per example "
                         f"with the model's outputs {produced}: a Keras loss needs targets of the outputs' shape")
    try:
        value = task.loss(outputs, tf.constant(y[:2]))
    except Exception as error:  # the user's loss: any exception means these labels do not fit it
        raise ValueError(f"loss {task.loss_name!r} cannot compare labels {y.dtype} {tuple(y.shape[1:])} per "
                         f"example with the model's outputs {tuple(outputs.shape[1:])}: "
                         f"{str(error).splitlines()[0] if str(error) else type(error).__name__}") from None
    if tuple(value.shape) != ():
        raise ValueError(f"loss {task.loss_name!r} gives shape {tuple(value.shape)}, not a number")


__all__ = ["ACCURACY_NAMES", "AUTO_LOSS", "DEFAULT_LOSS", "Task", "check_loss", "is_class_ids", "logits_mismatch",
           "make_loss", "make_metrics", "output_activation", "resolve_loss", "resolve_metrics", "resolve_task"]
