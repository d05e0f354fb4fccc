"""The grid: every point of a spec (the Cartesian product of its axes over the base settings)."""

from __future__ import annotations

import dataclasses
import itertools
import re
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from asyncps.config import RunConfig, coerce_settings
from asyncps.tools.experiment.errors import ExperimentError

RUN_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RunConfig))


@dataclass(frozen=True)
class Point:
    """One run of a sweep: its position, a human label, a directory name and its RunConfig."""

    index: int
    label: str
    slug: str
    axes: dict[str, Any]  # axis name -> the value (scalar) or label (mapping) this point takes
    config: RunConfig

    def settings(self) -> dict[str, Any]:
        """What `where` filters and check expressions see: every RunConfig field, the axes and the label."""
        return {**dataclasses.asdict(self.config), **self.axes, "label": self.label}


def make_run_config(fields: Mapping[str, Any]) -> RunConfig:
    """A RunConfig from spec fields: values coerced to the field's type (as in a --run-config file);
    no `epochs` given and a max_updates or max_training_s stop means epochs 0 (as with `asyncps local`)."""
    try:
        return RunConfig.from_layers(coerce_settings(fields, "spec"))
    except TypeError as exc:
        raise ExperimentError(str(exc)) from None


def format_value(value: Any) -> str:
    """A setting as labels and tables show it (floats in %g)."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def slug_of(text: str) -> str:
    """A directory-name-safe version of a label (other letters by their Unicode names: λ -> lamda)."""
    ascii_text = "".join(ch if ch.isascii() or not ch.isalnum() else unicodedata.name(ch, "_").split()[-1].lower()
                         for ch in text)
    return re.sub(r"[^A-Za-z0-9.=+-]+", "_", ascii_text).strip("_")[:80]


#: changes a point's fields (the fields, the point's axes) before its RunConfig is made: the tuned value
Adjust = Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class GridEntry:
    """A point of the grid before its RunConfig: its index, label, axes and fields."""

    index: int
    label: str
    axes: dict[str, Any]
    fields: dict[str, Any]

    def point(self, fields: Mapping[str, Any] | None = None, label: str = "", index: int = -1,
              axes: dict[str, Any] | None = None) -> Point:
        """The Point of these (or the given) fields; a bad configuration is an ExperimentError naming it."""
        index = self.index if index < 0 else index
        label = label or self.label
        try:
            config = make_run_config(self.fields if fields is None else fields)
        except ValueError as exc:
            raise ExperimentError(f"point {index} ({label}): {exc}") from None
        return Point(index, label, f"{index:02d}-{slug_of(label)}", self.axes if axes is None else axes, config)


def grid_entries(base: Mapping[str, Any], grid: Mapping[str, Sequence[Any]]) -> list[GridEntry]:
    """The Cartesian product of the grid's axes (first axis slowest) over the base settings, as fields."""
    axes = list(grid.items())
    entries = []
    for index, combo in enumerate(itertools.product(*(values for _, values in axes))):
        fields = dict(base)
        parts: list[str] = []
        chosen: dict[str, Any] = {}
        for (axis, _), value in zip(axes, combo, strict=True):
            if isinstance(value, dict):
                overrides = {k: v for k, v in value.items() if k != "label"}
                label = str(value.get("label") or ", ".join(f"{k}={format_value(v)}" for k, v in overrides.items()))
                fields.update(overrides)
                chosen[axis] = label
                parts.append(label)
            else:
                fields[axis] = value
                chosen[axis] = value
                parts.append(f"{axis}={format_value(value)}")
        entries.append(GridEntry(index, ", ".join(parts) or "base", chosen, fields))
    return entries


def expand_grid(base: Mapping[str, Any], grid: Mapping[str, Sequence[Any]],
                adjust: Adjust | None = None) -> list[Point]:
    """Every point of the grid (grid_entries) with its RunConfig (each point's fields through `adjust`, if
    given)."""
    return [e.point(None if adjust is None else adjust(e.fields, e.axes)) for e in grid_entries(base, grid)]
