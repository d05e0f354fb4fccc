"""Models with several outputs, trained through one array of labels and one of outputs.

Every role moves one array of labels per example, and the loss reads one output, so a model with several
outputs is wrapped: its outputs flattened and concatenated into one (asyncps.ml.models), its labels packed side by
side in the model's output order (asyncps.ml.multiio.pack_labels), and the wrapper compiled with `PerOutputLoss`
(each output's loss on its slices, weighted by `loss_weights` and summed, as `model.fit` sums them) and one
`OutputMetric` per output and metric (named `OUTPUT_METRIC`, as `model.fit` names them). Both are registered
Keras objects: the chief's export loads anywhere asyncps is installed.

An output's labels are class ids (one value per example) when its loss is a sparse one (its name says
`sparse`), else values of the output's shape.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import keras

from asyncps.ml.multiio import PER_OUTPUT_LOSS, OutputSpec


def _per_output(value: Any, names: Sequence[str], what: str) -> list[Any]:
    """A compile argument (one for all, a list in output order, a dict by output name) as a list per output."""
    if isinstance(value, Mapping):
        unknown = sorted(set(map(str, value)) - set(names))
        if unknown:
            raise ValueError(f"the model's {what} names outputs {unknown}, but its outputs are {list(names)}")
        return [value.get(name) for name in names]
    if isinstance(value, (list, tuple)) and len(value) == len(names) and (
            what != "metrics" or all(isinstance(v, (list, tuple)) or v is None for v in value)):
        return list(value)
    if isinstance(value, (list, tuple)) and what != "metrics":
        raise ValueError(f"the model's {what} has {len(value)} entries, but it has {len(names)} outputs "
                         f"({list(names)})")
    return [value] * len(names)


def _loss_name(loss: Any) -> str:
    """A loss's name (a string, a Loss object's name, a function's)."""
    return str(loss if isinstance(loss, str) else getattr(loss, "name", None) or getattr(loss, "__name__", loss))


def output_specs(user: Any, config: Mapping[str, Any] | None) -> list[OutputSpec]:
    """The user's outputs (name, shape, label shape) under its compile `config`; ValueError when it has no loss
    per output."""
    names = [str(n) for n in user.output_names]
    if not config or config.get("loss") is None:
        raise ValueError(f"the model has {len(names)} outputs {names}: compile it with a loss per output "
                         "(model.compile(loss={name: loss}), as model.fit needs)")
    losses = _per_output(keras.saving.deserialize_keras_object(config["loss"]), names, "loss")
    missing = [n for n, loss in zip(names, losses, strict=True) if loss is None]
    if missing:
        raise ValueError(f"the model's outputs {missing} have no loss: compile it with one per output")
    specs = []
    for name, tensor, loss in zip(names, user.outputs, losses, strict=True):
        shape = tuple(tensor.shape[1:])
        if any(d is None for d in shape):
            raise ValueError(f"the model's output {name!r} has shape {shape}: several outputs are packed into "
                             "one, which needs every dimension but the batch known")
        label = (1,) if "sparse" in _loss_name(loss) else tuple(int(d) for d in shape)
        specs.append(OutputSpec(name, tuple(int(d) for d in shape), label))
    return specs


def compile_per_output(model: Any, user: Any, config: Mapping[str, Any] | None) -> None:
    """Compile the wrapper `model` of the user's model of several outputs with its losses, loss weights and
    metrics per output (module doc)."""
    specs = output_specs(user, config)
    names = [s.name for s in specs]
    assert config is not None  # output_specs refused a model compiled without a loss
    losses = _per_output(keras.saving.deserialize_keras_object(config["loss"]), names, "loss")
    weights = _per_output(config.get("loss_weights"), names, "loss_weights")
    loss = PerOutputLoss([keras.losses.serialize(keras.losses.get(x)) if isinstance(x, str) else
                          keras.losses.serialize(x) for x in losses],
                         [1.0 if w is None else float(w) for w in weights], specs)
    metrics = keras.saving.deserialize_keras_object(config.get("metrics"))
    per_output = _per_output(metrics, names, "metrics") if metrics else [None] * len(names)
    measured = []
    for i, (spec, entries) in enumerate(zip(specs, per_output, strict=True)):
        for entry in entries if isinstance(entries, (list, tuple)) else [] if entries is None else [entries]:
            inner = _metric(entry, spec, losses[i])
            measured.append(OutputMetric(inner, specs, i, name=f"{spec.name}_{_metric_name(entry, inner)}"))
    model.compile(loss=loss, metrics=measured)


def _metric_name(entry: Any, inner: Any) -> str:
    """The name Keras gives an output's metric: the name given ("accuracy", "mae"), else the metric's own."""
    return entry if isinstance(entry, str) else str(inner.name)


def _metric(entry: Any, spec: OutputSpec, loss: Any) -> Any:
    """One output's metric as a keras.metrics.Metric: "accuracy" resolved as Keras' compile resolves it for the
    output's labels and loss, names and functions wrapped into a mean over the examples."""
    if isinstance(entry, keras.metrics.Metric):
        return entry
    if entry in ("accuracy", "acc"):
        name = _loss_name(loss)
        if spec.label_shape == (1,) and spec.shape != (1,):
            return keras.metrics.SparseCategoricalAccuracy(name="accuracy")
        if "categorical" in name:
            return keras.metrics.CategoricalAccuracy(name="accuracy")
        return keras.metrics.BinaryAccuracy(name="accuracy", threshold=0.0 if _from_logits(loss) else 0.5)
    found = keras.metrics.get(entry) if isinstance(entry, str) else entry
    if isinstance(found, keras.metrics.Metric):
        return found
    return keras.metrics.MeanMetricWrapper(found, name=getattr(found, "__name__", str(entry)))


def _from_logits(loss: Any) -> bool:
    """Whether a loss object reads logits (a name or a function: Keras' default, no)."""
    get_config = getattr(loss, "get_config", None)
    return bool(get_config().get("from_logits", False)) if get_config is not None else False


def _slices(specs: Sequence[OutputSpec], i: int, y_true: Any, y_pred: Any) -> tuple[Any, Any]:
    """Output `i`'s labels and outputs out of the packed ones, in their own shapes."""
    label_at = sum(math.prod(s.label_shape) for s in specs[:i])
    output_at = sum(math.prod(s.shape) for s in specs[:i])
    spec = specs[i]
    labels = y_true[:, label_at:label_at + math.prod(spec.label_shape)]
    labels = keras.ops.reshape(labels, (-1,) if spec.label_shape == (1,) and spec.shape != (1,)
                               else (-1, *spec.label_shape))
    outputs = keras.ops.reshape(y_pred[:, output_at:output_at + math.prod(spec.shape)], (-1, *spec.shape))
    return labels, outputs


def _specs_config(specs: Sequence[OutputSpec]) -> list[dict[str, Any]]:
    return [{"name": s.name, "shape": list(s.shape), "label_shape": list(s.label_shape)} for s in specs]


def _specs_of(config: Sequence[Mapping[str, Any]]) -> list[OutputSpec]:
    return [OutputSpec(str(c["name"]), tuple(c["shape"]), tuple(c["label_shape"])) for c in config]


@keras.saving.register_keras_serializable(package="asyncps")
class PerOutputLoss(keras.losses.Loss):  # type: ignore[misc]  # keras is untyped
    """The loss of a model of several outputs over its packed labels and outputs: per example, the sum of each
    output's loss (averaged over its other axes) times its weight; reduced over the batch as Keras reduces."""

    def __init__(self, losses: list[Any], weights: list[float], specs: Sequence[OutputSpec | Mapping[str, Any]],
                 **kwargs: Any) -> None:
        kwargs.setdefault("name", PER_OUTPUT_LOSS)
        super().__init__(**kwargs)
        self.loss_configs, self.weights = list(losses), [float(w) for w in weights]
        self.specs = [s if isinstance(s, OutputSpec) else _specs_of([s])[0] for s in specs]
        self._losses = [keras.losses.deserialize(c) for c in self.loss_configs]

    def call(self, y_true: Any, y_pred: Any) -> Any:
        """[batch, packed labels], [batch, packed outputs] -> [batch] weighted sum of the outputs' losses."""
        total = None
        for i, (loss, weight) in enumerate(zip(self._losses, self.weights, strict=True)):
            labels, outputs = _slices(self.specs, i, y_true, y_pred)
            value = loss.call(labels, outputs) if isinstance(loss, keras.losses.Loss) else loss(labels, outputs)
            value = keras.ops.cast(value, "float32")
            if len(value.shape) > 1:
                value = keras.ops.mean(value, axis=tuple(range(1, len(value.shape))))
            total = weight * value if total is None else total + weight * value
        return total

    def get_config(self) -> dict[str, Any]:
        """Serializable config."""
        return {"name": self.name, "reduction": self.reduction, "losses": self.loss_configs,
                "weights": self.weights, "specs": _specs_config(self.specs)}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> PerOutputLoss:
        """From get_config's dict."""
        return cls(config.pop("losses"), config.pop("weights"), _specs_of(config.pop("specs")), **config)


@keras.saving.register_keras_serializable(package="asyncps")
class OutputMetric(keras.metrics.Metric):  # type: ignore[misc]  # keras is untyped
    """One output's metric of a model of several outputs, measured on its slices of the packed labels and
    outputs."""

    def __init__(self, inner: Any, specs: Sequence[OutputSpec | Mapping[str, Any]], index: int,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.inner = inner if isinstance(inner, keras.metrics.Metric) else keras.metrics.deserialize(inner)
        self.specs = [s if isinstance(s, OutputSpec) else _specs_of([s])[0] for s in specs]
        self.index = int(index)

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> Any:
        """The inner metric's update on output `index`'s slices."""
        labels, outputs = _slices(self.specs, self.index, y_true, y_pred)
        return self.inner.update_state(labels, outputs, sample_weight=sample_weight)

    def result(self) -> Any:
        """The inner metric's result."""
        return self.inner.result()

    def reset_state(self) -> None:
        """Reset the inner metric."""
        self.inner.reset_state()

    def get_config(self) -> dict[str, Any]:
        """Serializable config."""
        return {"name": self.name, "dtype": self.dtype, "inner": keras.metrics.serialize(self.inner),
                "specs": _specs_config(self.specs), "index": self.index}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> OutputMetric:
        """From get_config's dict."""
        return cls(config.pop("inner"), _specs_of(config.pop("specs")), config.pop("index"), **config)


__all__ = ["OutputMetric", "PerOutputLoss", "compile_per_output", "output_specs"]
