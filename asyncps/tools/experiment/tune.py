"""The `tune` section: a per-variant search of one parameter on a validation split, before the measured runs.

```yaml
tune:
  parameter: outer.lr          # a RunConfig field (learning_rate), or FIELD.KEY: one key of a spec string
                               # (outer: "nesterov:lr=0.7,...") or of a mapping field (optimizer_params)
  values: [0.1, 0.3, 0.7]      # the candidates, each tried in a short tuning run
  select: {metric: final_accuracy, goal: max}   # the default; any metric of METRICS, goal max or min
  per: [variant, seed]         # optional: the axes a choice is made for (default: every grid axis)
  seed_offset: 1000            # optional: a tuning run's seed is the measured seed + this (default 1000)
  base: {epochs: 8}            # optional: RunConfig fields of the tuning runs only (shorter runs)
```

For every combination of the `per` axes' values (the other axes at their first value) and every
candidate, a tuning run trains on the measured run's training split less a held-out share and evaluates
on that share (dataset `validation:SEED:DATASET`, asyncps.ml.specs: SEED is the measured run's seed, so
the held-out examples are training examples of the measured run, never its test set), with the seed
`seed + seed_offset` (its initialization, data order and delays differ from the measured run's). Its
score is `select.metric` of the run (the final evaluation is on the validation split): the candidate
with the highest (`goal: max`) or lowest (`min`) score is chosen, a missing score (a failed run, a target
never reached) ranking last, ties going to the candidate listed first. Every measured point then runs
with its combination's chosen value in place of the spec's; the checks compare each variant at its own
choice.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncps.config import RunConfig
from asyncps.ml.specs import VALIDATION_PREFIX
from asyncps.tools.experiment.errors import ExperimentError
from asyncps.tools.experiment.grid import RUN_FIELDS, GridEntry, Point, expand_grid, format_value, grid_entries
from asyncps.tools.experiment.metrics import METRICS

TUNE_KEYS = ("parameter", "values", "select", "per", "seed_offset", "base")
DEFAULT_SEED_OFFSET = 1000
GOALS = ("max", "min")
#: fields a tuning run sets itself (`base` may not): its seed and its validation dataset
_DERIVED = ("seed", "dataset")


@dataclass(frozen=True)
class Tune:
    """A parsed `tune` section."""

    parameter: str
    values: tuple[float, ...]
    metric: str = "final_accuracy"
    goal: str = "max"
    per: tuple[str, ...] = ()  # empty: every grid axis
    seed_offset: int = DEFAULT_SEED_OFFSET
    base: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """E.g. `outer.lr over 0.1, 0.3, 0.7 by the highest final_accuracy on the validation split`."""
        best = "highest" if self.goal == "max" else "lowest"
        return (f"{self.parameter} over {', '.join(format_value(v) for v in self.values)} by the {best} "
                f"{self.metric} of a tuning run on the validation split (seed + {self.seed_offset})")


def parse_tune(data: Any, grid: Mapping[str, Sequence[Any]]) -> Tune:
    """A Tune from the spec's `tune` mapping; every problem is an ExperimentError naming the key."""
    if not isinstance(data, dict):
        raise ExperimentError("tune must be a mapping with keys " + ", ".join(TUNE_KEYS))
    unknown = sorted(set(data) - set(TUNE_KEYS))
    if unknown:
        raise ExperimentError(f"tune: unknown keys {unknown}; valid: {', '.join(TUNE_KEYS)}")
    parameter = data.get("parameter")
    if not isinstance(parameter, str) or not parameter:
        raise ExperimentError("tune.parameter must name a RunConfig field (learning_rate) or FIELD.KEY (outer.lr)")
    name, _, key = parameter.partition(".")
    if name not in RUN_FIELDS or (not key and "." in parameter):
        raise ExperimentError(f"tune.parameter {parameter!r}: {name!r} is not a RunConfig field; "
                              f"fields: {', '.join(RUN_FIELDS)}")
    if name in _DERIVED:
        raise ExperimentError(f"tune.parameter {parameter!r}: a tuning run sets its {name} itself")
    values = data.get("values")
    if not isinstance(values, list) or len(values) < 2:
        raise ExperimentError("tune.values must be a list of at least 2 candidates")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        raise ExperimentError(f"tune.values must be finite numbers, got {values!r}")
    if len(set(values)) != len(values):
        raise ExperimentError(f"tune.values lists a candidate twice: {values!r}")
    select = data.get("select") or {}
    if not isinstance(select, dict) or set(select) - {"metric", "goal"}:
        raise ExperimentError("tune.select must be {metric: METRIC, goal: max|min}")
    metric, goal = str(select.get("metric", "final_accuracy")), str(select.get("goal", "max"))
    if metric not in METRICS:
        raise ExperimentError(f"tune.select.metric {metric!r} is not a metric; metrics: {', '.join(METRICS)}")
    if goal not in GOALS:
        raise ExperimentError(f"tune.select.goal must be max or min, got {goal!r}")
    per = data.get("per") or list(grid)
    if not isinstance(per, list) or not all(isinstance(a, str) for a in per):
        raise ExperimentError("tune.per must be a list of grid axes")
    missing = [a for a in per if a not in grid]
    if missing:
        raise ExperimentError(f"tune.per: {missing} not grid axes; axes: {', '.join(grid)}")
    offset = data.get("seed_offset", DEFAULT_SEED_OFFSET)
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 1:
        raise ExperimentError(f"tune.seed_offset must be an integer >= 1, got {offset!r}")
    seeds = {int(s) for s in grid.get("seed", [])}
    clash = sorted(s + offset for s in seeds if s + offset in seeds)
    if clash:
        raise ExperimentError(f"tune.seed_offset {offset}: tuning seeds {clash} are measured seeds too")
    base = data.get("base") or {}
    if not isinstance(base, dict):
        raise ExperimentError("tune.base must be a mapping of RunConfig fields")
    bad = sorted(set(base) - set(RUN_FIELDS))
    if bad:
        raise ExperimentError(f"tune.base: unknown RunConfig fields {bad}")
    fixed = sorted(set(base) & {*_DERIVED, name})
    if fixed:
        raise ExperimentError(f"tune.base may not set {fixed}: the tuning runs set them")
    # the numbers as written: an integer field (local_steps) takes integers
    return Tune(parameter, tuple(values), metric, goal, tuple(per or grid), offset, dict(base))


def set_parameter(fields: Mapping[str, Any], parameter: str, value: float) -> dict[str, Any]:
    """`fields` with the tuned parameter at `value`: a field itself, or FIELD.KEY: the key of a mapping field
    or of a `name:key=value,...` spec string (replaced where it is there, else added)."""
    name, _, key = parameter.partition(".")
    out = dict(fields)
    if not key:
        out[name] = value
        return out
    current = out.get(name, getattr(RunConfig(), name))
    if isinstance(current, dict):
        out[name] = {**current, key: value}
    elif isinstance(current, str):
        kind, _, args = current.partition(":")
        parts = [p for p in args.split(",") if p.strip()]
        pairs = [p.partition("=") for p in parts]
        if any(not eq for _, eq, _ in pairs):
            raise ExperimentError(f"tune.parameter {parameter!r}: {name} {current!r} is not name:key=value,...")
        kept = [f"{k}={v}" if k.strip() != key else f"{key}={format_value(value)}" for k, _, v in pairs]
        if all(k.strip() != key for k, _, _ in pairs):
            kept.append(f"{key}={format_value(value)}")
        out[name] = f"{kind}:{','.join(kept)}"
    else:
        raise ExperimentError(f"tune.parameter {parameter!r}: {name} is neither a mapping nor a spec string")
    return out


Key = tuple[tuple[str, Any], ...]


def key_of(tune: Tune, axes: Mapping[str, Any]) -> Key:
    """The `per` axes' values of a point: what its choice is made for."""
    return tuple((a, axes[a]) for a in tune.per)


def key_label(key: Key) -> str:
    """E.g. `seed=0, async nesterov` (mapping axes by their label)."""
    return ", ".join(v if isinstance(v, str) else f"{a}={format_value(v)}" for a, v in key) or "base"


@dataclass(frozen=True)
class TuneRun:
    """One tuning run: the choice it informs (key), its candidate value and its point (under OUT/tune/)."""

    key: Key
    value: float
    point: Point


def tuning_fields(tune: Tune, fields: Mapping[str, Any], value: float) -> dict[str, Any]:
    """A measured point's fields turned into its tuning run's at `value`: tune.base over them, the parameter,
    the seed moved by seed_offset and the dataset's validation split of the measured seed's training data."""
    out = set_parameter({**fields, **tune.base}, tune.parameter, value)
    seed = int(out.get("seed", RunConfig().seed))
    out["seed"] = seed + tune.seed_offset
    out["dataset"] = f"{VALIDATION_PREFIX}{seed}:{out.get('dataset', RunConfig().dataset)}"
    return out


def _representatives(tune: Tune, base: Mapping[str, Any], grid: Mapping[str, Sequence[Any]]) -> list[GridEntry]:
    """The first grid entry of each combination of the `per` axes' values (the other axes at their first value)."""
    first: dict[Key, GridEntry] = {}
    for entry in grid_entries(base, grid):
        first.setdefault(key_of(tune, entry.axes), entry)
    return list(first.values())


def tune_runs(tune: Tune, base: Mapping[str, Any], grid: Mapping[str, Sequence[Any]]) -> list[TuneRun]:
    """Every tuning run, by choice then candidate: one per combination of the `per` axes (the first point of
    the grid with those values: the other axes at their first value) and candidate."""
    runs: list[TuneRun] = []
    for entry in _representatives(tune, base, grid):
        for value in tune.values:
            label = f"{entry.label}, {tune.parameter}={format_value(value)}"
            point = entry.point(tuning_fields(tune, entry.fields, value), label, len(runs))
            runs.append(TuneRun(key_of(tune, entry.axes), value, point))
    return runs


def check_candidates(tune: Tune, base: Mapping[str, Any], grid: Mapping[str, Sequence[Any]]) -> None:
    """An ExperimentError unless every tuning run, and the measured run of each choice's first point at every
    candidate, is a valid RunConfig (the other points differ from those in axes the grid itself validates)."""
    tune_runs(tune, base, grid)
    for entry in _representatives(tune, base, grid):
        for value in tune.values:
            entry.point(set_parameter(entry.fields, tune.parameter, value),
                        f"{entry.label} at {tune.parameter}={format_value(value)}")


@dataclass(frozen=True)
class TuneChoice:
    """The outcome of one choice: each candidate's score (NaN: none) and the value chosen."""

    key: Key
    seed: int  # the tuning runs' seed
    scores: tuple[tuple[float, float], ...]  # (candidate, score) in the order of tune.values
    value: float


def choose(tune: Tune, runs: Sequence[TuneRun], scores: Mapping[str, float]) -> list[TuneChoice]:
    """Each choice's best candidate (by point slug's score, see the module docstring); an ExperimentError
    when no candidate of a choice has a score."""
    by_key: dict[Key, list[TuneRun]] = {}
    for r in runs:
        by_key.setdefault(r.key, []).append(r)
    choices = []
    for key, candidates in by_key.items():
        scored = [(r.value, scores.get(r.point.slug, math.nan)) for r in candidates]
        ranked = [(s if tune.goal == "max" else -s, -i, v) for i, (v, s) in enumerate(scored) if not math.isnan(s)]
        if not ranked:
            raise ExperimentError(f"tuning {tune.parameter} for {key_label(key)}: no candidate has a {tune.metric} "
                                  f"(see {', '.join('tune/' + r.point.slug for r in candidates)})")
        choices.append(TuneChoice(key, candidates[0].point.config.seed, tuple(scored), max(ranked)[2]))
    return choices


def tuned_points(tune: Tune, base: Mapping[str, Any], grid: Mapping[str, Sequence[Any]],
                 choices: Sequence[TuneChoice]) -> tuple[list[Point], dict[str, float]]:
    """The measured points, each at its choice's value; and the chosen value by point slug."""
    chosen = {c.key: c.value for c in choices}

    def adjust(fields: dict[str, Any], axes: dict[str, Any]) -> dict[str, Any]:
        return set_parameter(fields, tune.parameter, chosen[key_of(tune, axes)])

    points = expand_grid(base, grid, adjust=adjust)
    return points, {p.slug: chosen[key_of(tune, p.axes)] for p in points}


def at_edge(tune: Tune, choice: TuneChoice) -> bool:
    """True when the choice is the smallest or the largest candidate: the best value may lie outside the grid."""
    return choice.value in (min(tune.values), max(tune.values))


def edge_note(tune: Tune, choices: Sequence[TuneChoice]) -> str:
    """A warning when choices fell on the grid's edge ("" when none did)."""
    edge = [c for c in choices if at_edge(tune, c)]
    if not edge:
        return ""
    return (f"{len(edge)} of {len(choices)} choices are the grid's smallest or largest {tune.parameter} "
            f"(marked *): the best value may lie outside the grid; widen it to know")


def tune_markdown(tune: Tune, choices: Sequence[TuneChoice]) -> str:
    """results.md's tuning section: the rule, then one row per choice with every candidate's score (a choice at
    the grid's edge marked *, with a note)."""
    header = ["tuned for", "tuning seed", *(f"{tune.parameter}={format_value(v)}" for v in tune.values), "chosen"]
    lines = [f"## Tuning\n\n{tune.describe()}; `tune.csv` has every tuning run.\n",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for c in choices:
        cells = ["—" if math.isnan(s) else f"{s:.4g}" for _, s in c.scores]
        chosen = format_value(c.value) + (" *" if at_edge(tune, c) else "")
        lines.append("| " + " | ".join([key_label(c.key), str(c.seed), *cells, chosen]) + " |")
    note = edge_note(tune, choices)
    return "\n".join(lines) + "\n" + (f"\n{note}.\n" if note else "")


__all__ = ["DEFAULT_SEED_OFFSET", "TUNE_KEYS", "Key", "Tune", "TuneChoice", "TuneRun", "at_edge", "check_candidates",
           "choose", "edge_note", "key_label", "key_of", "parse_tune", "set_parameter", "tune_markdown", "tune_runs",
           "tuned_points", "tuning_fields"]
