"""The spec file: its keys, parsing and validation (every grid point and check included)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncps.config import parse_toml
from asyncps.tools.experiment.checks import Check, parse_check
from asyncps.tools.experiment.errors import ExperimentError
from asyncps.tools.experiment.grid import RUN_FIELDS, Point, expand_grid
from asyncps.tools.experiment.metrics import Target
from asyncps.tools.experiment.tune import Tune, TuneChoice, check_candidates, parse_tune, tune_runs, tuned_points

SPEC_KEYS = ("name", "description", "base", "grid", "target", "check", "reduced", "tune")


@dataclass(frozen=True)
class ExperimentSpec:
    """A parsed spec: the base run settings, the grid to sweep, the target and the expected outcome."""

    name: str
    description: str
    base: dict[str, Any]
    grid: dict[str, list[Any]]
    target: Target | None = None
    checks: tuple[Check, ...] = ()
    tune: Tune | None = None

    def points(self) -> list[Point]:
        """Every point of the grid, validated (see expand_grid); with a `tune` section, at the spec's own
        value of the tuned parameter (the measured runs take the chosen ones: tuned_points)."""
        return expand_grid(self.base, self.grid)

    def tune_points(self) -> list[Point]:
        """The tuning runs' points (none without a `tune` section), in the order they run."""
        return [] if self.tune is None else [r.point for r in tune_runs(self.tune, self.base, self.grid)]

    def tuned_points(self, choices: list[TuneChoice]) -> tuple[list[Point], dict[str, float]]:
        """The measured points at the chosen values, and the chosen value by point slug."""
        if self.tune is None:
            return self.points(), {}
        return tuned_points(self.tune, self.base, self.grid, choices)


def load_spec(path: Path, reduced: bool = False) -> ExperimentSpec:
    """Read a YAML (.yaml, .yml) or TOML (.toml) spec and validate it, every grid point included."""
    text = path.read_text()
    data: Any
    if path.suffix == ".toml":
        try:
            data = parse_toml(text)
        except ValueError as exc:
            raise ExperimentError(f"{path}: {exc}") from None
    elif path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ExperimentError(f"{path}: {exc}") from None
    else:
        raise ExperimentError(f"{path}: a spec is .yaml, .yml or .toml")
    return parse_spec(data, default_name=path.stem, reduced=reduced)


def reduce_spec(data: dict[str, Any]) -> dict[str, Any]:
    """The spec's reduced version (for CI): its `reduced` mapping's `base` fields over the base, its
    `grid` axes in place of the same axes (others kept); the checks stay the same except those marked
    `full_only` (with the reason: a claim too noisy for the reduced run's few seeds is checked by the
    full sweep only)."""
    reduced = data.get("reduced") or {}
    if not isinstance(reduced, dict) or set(reduced) - {"base", "grid", "tune"}:
        raise ExperimentError("reduced must be a mapping with base, grid and/or tune")
    for key in ("base", "grid", "tune"):
        if not isinstance(reduced.get(key) or {}, dict):
            raise ExperimentError(f"reduced.{key} must be a mapping")
    out = {k: v for k, v in data.items() if k != "reduced"}
    out["base"] = {**(data.get("base") or {}), **(reduced.get("base") or {})}
    out["grid"] = {**(data.get("grid") or {}), **(reduced.get("grid") or {})}
    if reduced.get("tune"):
        if not isinstance(data.get("tune"), dict):
            raise ExperimentError("reduced.tune changes a tune section: the spec has none")
        out["tune"] = {**data["tune"], **reduced["tune"]}
    if data.get("name"):
        out["name"] = f"{data['name']}_reduced"
    checks = data.get("check") or []
    if isinstance(checks, list):
        out["check"] = [c for c in checks if not (isinstance(c, dict) and c.get("full_only"))]
    return out


def parse_spec(data: Any, default_name: str = "experiment", reduced: bool = False) -> ExperimentSpec:
    """Build an ExperimentSpec from the spec file's mapping (its reduced version when `reduced`);
    every problem is an ExperimentError. A spec with a `reduced` section must be valid both ways."""
    if not isinstance(data, dict):
        raise ExperimentError("a spec is a mapping with keys " + ", ".join(SPEC_KEYS))
    if "reduced" in data:
        small = reduce_spec(data)
        if reduced:
            return parse_spec(small, default_name + "_reduced")
        parse_spec(small, default_name + "_reduced")
    unknown = sorted(set(data) - set(SPEC_KEYS))
    if unknown:
        raise ExperimentError(f"unknown spec keys {unknown}; valid: {', '.join(SPEC_KEYS)}")
    base = data.get("base") or {}
    if not isinstance(base, dict):
        raise ExperimentError("base must be a mapping of RunConfig fields")
    _check_run_fields(base, "base")
    grid_data = data.get("grid") or {}
    if not isinstance(grid_data, dict):
        raise ExperimentError("grid must be a mapping of axis name -> list of values")
    grid: dict[str, list[Any]] = {}
    for axis, values in grid_data.items():
        if not isinstance(values, list) or not values:
            raise ExperimentError(f"grid.{axis} must be a non-empty list")
        for value in values:
            if isinstance(value, dict):
                _check_run_fields({k: v for k, v in value.items() if k != "label"}, f"grid.{axis}")
            elif axis not in RUN_FIELDS:
                raise ExperimentError(f"grid.{axis}: {axis!r} is not a RunConfig field, so its values must be "
                                      f"mappings of fields (with an optional label); fields: {', '.join(RUN_FIELDS)}")
        grid[str(axis)] = list(values)
    target = None
    if data.get("target") is not None:
        t = data["target"]
        if not isinstance(t, dict) or set(t) != {"metric", "value"}:
            raise ExperimentError("target must be {metric: accuracy|loss, value: NUMBER}")
        try:
            target = Target(str(t["metric"]), float(t["value"]))
        except (TypeError, ValueError) as exc:
            raise ExperimentError(f"target: {exc}") from None
    check_data = data.get("check") or []
    if isinstance(check_data, dict):
        check_data = [check_data]
    if not isinstance(check_data, list):
        raise ExperimentError("check must be a mapping or a list of mappings")
    names = set(RUN_FIELDS) | set(grid) | {"label"}
    checks = tuple(parse_check(c, names, i) for i, c in enumerate(check_data))
    tune = None if data.get("tune") is None else parse_tune(data["tune"], grid)
    spec = ExperimentSpec(name=str(data.get("name") or default_name), description=str(data.get("description") or ""),
                          base=dict(base), grid=grid, target=target, checks=checks, tune=tune)
    spec.points()  # every point must be a valid RunConfig before anything runs
    if tune is not None:  # and every tuning run, and every measured point at each candidate
        try:
            check_candidates(tune, base, grid)
        except ExperimentError as exc:
            raise ExperimentError(f"tune ({tune.parameter}): {exc}") from None
    return spec


def _check_run_fields(fields: Mapping[str, Any], where: str) -> None:
    unknown = sorted(set(fields) - set(RUN_FIELDS))
    if unknown:
        raise ExperimentError(f"{where}: unknown RunConfig fields {unknown}; valid: {', '.join(RUN_FIELDS)}")
