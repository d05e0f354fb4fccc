"""Models with several inputs or outputs, trained through one array of features and one of labels per example.

Every role moves one array of features [n, k] (the data tasks, the wire, the chief's evaluation), so a model
with several inputs reads them packed: each input's values flattened and set side by side, in the model's
input order (`pack`); a wrapper around the model slices them back (asyncps.ml.models: InputSlice). The packed
array is int64 when every input of the model is integer (ids stay exact), else float32: integer inputs then
must lie within +-2**24, which float32 holds exactly. `x` is given as `keras.Model.fit` takes it: a list in
the model's input order, or a dict keyed by its input names.

Several outputs' labels are packed the same way, as float32 (class ids exact below 2**24), in the model's output
order (`pack_labels`): class ids (one value per example) for an output whose loss is sparse, else values of the
output's shape (asyncps.ml.heads, which also holds the loss and metrics that read them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

#: The largest integer magnitude float32 holds exactly (every integer up to it).
FLOAT32_EXACT = 2**24
#: The name of the loss of a model of several outputs (asyncps.ml.heads.PerOutputLoss).
PER_OUTPUT_LOSS = "per_output_loss"


@dataclass(frozen=True)
class InputSpec:
    """One input of a model: its name, its shape per example and its dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def width(self) -> int:
        """How many packed values one example of this input takes."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class OutputSpec:
    """One output of a model: its name, its shape per example and the shape of its labels per example."""

    name: str
    shape: tuple[int, ...]
    label_shape: tuple[int, ...]


def input_specs(model: Any) -> list[InputSpec]:
    """The model's inputs in order; ValueError for one whose shape per example is not fully known."""
    specs = []
    for tensor in model.inputs:
        shape = tuple(tensor.shape[1:])
        name = str(getattr(tensor, "name", "") or "").split(":")[0]
        if any(d is None for d in shape):
            raise ValueError(f"the model's input {name!r} has shape {shape}: several inputs are packed into one "
                             "array, which needs every dimension but the batch known")
        specs.append(InputSpec(name, tuple(int(d) for d in shape), str(tensor.dtype)))
    return specs


def packed_dtype(specs: Sequence[InputSpec]) -> type[np.generic]:
    """int64 when every input is integer (ids stay exact), else float32."""
    return np.int64 if all("int" in s.dtype for s in specs) else np.float32


def is_several(x: Any) -> bool:
    """Whether `x` is several arrays (a dict, or a list or tuple of arrays), not one array (nested lists of numbers)."""
    return isinstance(x, Mapping) or (isinstance(x, (list, tuple)) and bool(x) and all(hasattr(a, "shape") for a in x))


def arrange(x: Any, names: Sequence[str], what: str) -> list[Any]:
    """`x` (a list in input order or a dict keyed by input name) as a list in the order of `names`;
    ValueError naming what differs."""
    if isinstance(x, Mapping):
        given, wanted = set(map(str, x)), set(names)
        if given != wanted:
            missing, extra = sorted(wanted - given), sorted(given - wanted)
            raise ValueError(f"{what} is keyed by {sorted(given)}, but the model's are {list(names)}"
                             + (f" (missing {missing})" if missing else "") + (f" (unknown {extra})" if extra else ""))
        return [x[name] for name in names]
    if len(x) != len(names):
        raise ValueError(f"{what} has {len(x)} arrays, but the model has {len(names)} ({list(names)})")
    return list(x)


def pack(x: Any, specs: Sequence[InputSpec], what: str = "x") -> np.ndarray:
    """The arrays of `x` (list or dict, see `arrange`) packed into one [n, sum of widths] array (module doc)."""
    arrays = [np.asarray(a) for a in arrange(x, [s.name for s in specs], what)]
    counts = {len(a) if a.ndim else 0 for a in arrays}
    if len(counts) != 1:
        lengths = {s.name: (len(a) if a.ndim else 0) for s, a in zip(specs, arrays, strict=True)}
        raise ValueError(f"{what}: its arrays have different numbers of examples {lengths}")
    dtype = packed_dtype(specs)
    columns = [_column(a, s, dtype, what) for a, s in zip(arrays, specs, strict=True)]
    return np.concatenate(columns, axis=1)


def _column(array: np.ndarray, spec: InputSpec, dtype: type[np.generic], what: str) -> np.ndarray:
    """One input's examples flattened to [n, width] in the packed dtype; ValueError for a wrong shape or values
    the packed dtype would change."""
    if array.ndim == len(spec.shape) and spec.shape[-1:] == (1,):
        array = array[..., None]  # ids [n] for an input of shape (1,), as Keras takes them
    if tuple(array.shape[1:]) != spec.shape:
        raise ValueError(f"{what}[{spec.name!r}] has examples of shape {tuple(array.shape[1:])}, but the model "
                         f"takes {spec.shape}")
    if not (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_):
        raise ValueError(f"{what}[{spec.name!r}] is not numeric ({array.dtype})")
    if dtype is np.float32 and np.issubdtype(array.dtype, np.integer) and array.size and (
            np.abs(array).max() > FLOAT32_EXACT):
        raise ValueError(f"{what}[{spec.name!r}] holds integers beyond 2**24, which the packed float32 features "
                         "would round (ids beside float inputs must stay below 2**24)")
    if dtype is np.int64 and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{what}[{spec.name!r}] is {array.dtype}, but the model's inputs are all integer")
    return array.reshape(len(array), -1).astype(dtype)


def pack_labels(y: Any, specs: Sequence[OutputSpec], what: str = "y") -> np.ndarray:
    """The label arrays of `y` (a list in output order or a dict keyed by output name) packed into one float32
    [n, sum of label widths] array (module doc)."""
    arrays = [np.asarray(a) for a in arrange(y, [s.name for s in specs], what)]
    as_inputs = [InputSpec(s.name, s.label_shape, "float32") for s in specs]
    counts = {len(a) if a.ndim else 0 for a in arrays}
    if len(counts) != 1:
        lengths = {s.name: (len(a) if a.ndim else 0) for s, a in zip(specs, arrays, strict=True)}
        raise ValueError(f"{what}: its arrays have different numbers of examples {lengths}")
    return np.concatenate([_column(a, s, np.float32, what) for a, s in zip(arrays, as_inputs, strict=True)], axis=1)


__all__ = ["FLOAT32_EXACT", "PER_OUTPUT_LOSS", "InputSpec", "OutputSpec", "arrange", "input_specs", "is_several",
           "pack", "pack_labels", "packed_dtype"]
