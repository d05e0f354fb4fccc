"""`asyncps experiment`: sweeps of local clusters over a grid of run settings, with an automatic check.

A spec is a YAML or TOML file:

```yaml
name: e3_straggler                     # optional; default: the file's stem
description: one 4x straggler ...      # optional; copied into results.md
base: {model: logreg, num_workers: 4, compute_delay: "const:0.05", max_seconds: 5}
grid:                                  # the Cartesian product of every axis, first axis slowest
  seed: [0, 1]                         # an axis named after a RunConfig field: scalar values
  variant:                             # any other name: mappings of several fields (+ a label)
    - {label: sync, mode: sync}
    - {label: sync+1 backup, mode: sync, backup_workers: 1}
target: {metric: accuracy, value: 0.9} # optional: time and updates until the eval reaches it
check:                                 # optional: the expected outcome (list of claims)
  - {kind: compare, metric: updates_per_s, left: {variant: sync+1 backup}, op: ">=", factor: 2,
     right: {variant: sync}, why: "Chen et al. 2016: ..."}
```

Each point runs as a local cluster (one after another, one progress line each) in
`OUT/NN-label/`; a point whose directory already holds a finished `summary.json` is not run
again, so an interrupted sweep resumes where it stopped. The sweep writes `results.csv` and
`results.md`, evaluates the check and prints PASS or FAIL with the measured numbers.

Check kinds (every claim has a `metric`, an optional `where` row filter and a `why`):
- `approx`: every selected row has metric within `abs_tol + rel_tol * |expected|` of `expected`, an
  arithmetic expression over the row's settings and metrics (e.g. `num_workers - 1`);
- `trend`: the metric, averaged per value of `by`, moves in `direction` (increasing, decreasing,
  nondecreasing, nonincreasing) with optional `abs_slack` / `rel_slack` per neighbour and an optional
  `min_ratio` between the last and the first group (or the first and the last, when decreasing);
- `compare`: an aggregate (`left_agg`, default mean) of the `left` rows `op` (`<`, `<=`, `>`, `>=`)
  `factor` times an aggregate (`right_agg`) of the `right` rows.
"""

from __future__ import annotations

import abc
import ast
import contextlib
import csv
import dataclasses
import itertools
import json
import math
import operator
import re
import shutil
import sys
import time
import unicodedata
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, ClassVar

from asyncps.config import RunConfig, coerce_settings


class ExperimentError(ValueError):
    """A spec or an output directory that cannot be used (reported as one line by the CLI)."""


RUN_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RunConfig))
SPEC_KEYS = ("name", "description", "base", "grid", "target", "check")

#: The metrics of every point, in results.csv order; checks and targets refer to them by name.
METRICS: tuple[str, ...] = (
    "updates", "wall_s", "updates_per_s", "gradients_per_s", "staleness_mean", "staleness_steady_mean",
    "staleness_p95", "staleness_max", "dropped_pct", "idle_pct", "time_to_target_s", "updates_to_target",
    "final_accuracy", "final_loss", "optimality_gap", "run_s",
)


# -- the spec ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """An evaluation level to reach: accuracy at least `value`, or loss at most `value`."""

    metric: str
    value: float

    def __post_init__(self) -> None:
        if self.metric not in ("accuracy", "loss"):
            raise ExperimentError(f"target metric must be accuracy or loss, got {self.metric!r}")
        if not math.isfinite(self.value):
            raise ExperimentError(f"target value must be a finite number, got {self.value!r}")

    def reached(self, loss: float, accuracy: float) -> bool:
        """True when an evaluation with this loss and accuracy meets the target."""
        return accuracy >= self.value if self.metric == "accuracy" else loss <= self.value

    def describe(self) -> str:
        """E.g. `accuracy >= 0.9`."""
        return f"{self.metric} {'>=' if self.metric == 'accuracy' else '<='} {self.value:g}"


@dataclass(frozen=True)
class ExperimentSpec:
    """A parsed spec: the base run settings, the grid to sweep, the target and the expected outcome."""

    name: str
    description: str
    base: dict[str, Any]
    grid: dict[str, list[Any]]
    target: Target | None = None
    checks: tuple[Check, ...] = ()

    def points(self) -> list[Point]:
        """Every point of the grid, validated (see expand_grid)."""
        return expand_grid(self)


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


def load_spec(path: Path) -> ExperimentSpec:
    """Read a YAML (.yaml, .yml) or TOML (.toml) spec and validate it, every grid point included."""
    text = path.read_text()
    data: Any
    if path.suffix == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            raise ExperimentError(f"{path}: TOML specs need Python 3.11 or later (tomllib); use YAML") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ExperimentError(f"{path}: {exc}") from None
    elif path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ExperimentError(f"{path}: {exc}") from None
    else:
        raise ExperimentError(f"{path}: a spec is .yaml, .yml or .toml")
    return parse_spec(data, default_name=path.stem)


def parse_spec(data: Any, default_name: str = "experiment") -> ExperimentSpec:
    """Build an ExperimentSpec from the spec file's mapping; every problem is an ExperimentError."""
    if not isinstance(data, dict):
        raise ExperimentError("a spec is a mapping with keys " + ", ".join(SPEC_KEYS))
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
    spec = ExperimentSpec(name=str(data.get("name") or default_name), description=str(data.get("description") or ""),
                          base=dict(base), grid=grid, target=target, checks=checks)
    spec.points()  # every point must be a valid RunConfig before anything runs
    return spec


def _check_run_fields(fields: Mapping[str, Any], where: str) -> None:
    unknown = sorted(set(fields) - set(RUN_FIELDS))
    if unknown:
        raise ExperimentError(f"{where}: unknown RunConfig fields {unknown}; valid: {', '.join(RUN_FIELDS)}")


def make_run_config(fields: Mapping[str, Any]) -> RunConfig:
    """A RunConfig from spec fields: values coerced to the field's type (as in a --run-config file);
    no `epochs` given and a max_updates or max_seconds stop means epochs 0 (as with `asyncps local`)."""
    try:
        return RunConfig.from_layers(coerce_settings(fields, "spec"))
    except TypeError as exc:
        raise ExperimentError(str(exc)) from None


def _format_value(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _slug(text: str) -> str:
    """A directory-name-safe version of a label (other letters by their Unicode names: λ -> lamda)."""
    ascii_text = "".join(ch if ch.isascii() or not ch.isalnum() else unicodedata.name(ch, "_").split()[-1].lower()
                         for ch in text)
    return re.sub(r"[^A-Za-z0-9.=+-]+", "_", ascii_text).strip("_")[:80]


def expand_grid(spec: ExperimentSpec) -> list[Point]:
    """The Cartesian product of the grid's axes (first axis slowest) over the base settings."""
    axes = list(spec.grid.items())
    points = []
    for index, combo in enumerate(itertools.product(*(values for _, values in axes))):
        fields = dict(spec.base)
        parts: list[str] = []
        chosen: dict[str, Any] = {}
        for (axis, _), value in zip(axes, combo, strict=True):
            if isinstance(value, dict):
                overrides = {k: v for k, v in value.items() if k != "label"}
                label = str(value.get("label") or ", ".join(f"{k}={_format_value(v)}" for k, v in overrides.items()))
                fields.update(overrides)
                chosen[axis] = label
                parts.append(label)
            else:
                fields[axis] = value
                chosen[axis] = value
                parts.append(f"{axis}={_format_value(value)}")
        label = ", ".join(parts) or "base"
        try:
            config = make_run_config(fields)
        except ValueError as exc:
            raise ExperimentError(f"point {index} ({label}): {exc}") from None
        points.append(Point(index, label, f"{index:02d}-{_slug(label)}", chosen, config))
    return points


# -- one run's metrics --------------------------------------------------------------------------
def read_csv(path: Path) -> list[dict[str, str]]:
    """The rows of a CSV file with a header (empty when the file does not exist)."""
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def load_summary(run_dir: Path) -> dict[str, Any]:
    """A run directory's summary.json."""
    data: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    return data


def _float(text: Any) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


def time_to_target(eval_rows: Sequence[Mapping[str, str]], target: Target) -> tuple[float, float]:
    """(seconds, updates) at which the evaluations first meet the target; NaN, NaN if they never do.

    Linearly interpolated between the last evaluation short of the target and the first that meets
    it: evaluations are ~0.3-1 s apart, too coarse on their own to compare runs a few updates apart.
    """
    previous: tuple[float, float, float] | None = None
    for row in eval_rows:
        loss, accuracy = _float(row.get("loss")), _float(row.get("accuracy"))
        elapsed, updates = _float(row.get("elapsed_s")), _float(row.get("updates"))
        value = accuracy if target.metric == "accuracy" else loss
        if target.reached(loss, accuracy):
            if previous is None or value == previous[2] or math.isnan(previous[2]):
                return elapsed, updates
            frac = min(1.0, max(0.0, (target.value - previous[2]) / (value - previous[2])))
            return (previous[0] + frac * (elapsed - previous[0]), previous[1] + frac * (updates - previous[1]))
        previous = (elapsed, updates, value)
    return math.nan, math.nan


def steady_staleness(pushes: Sequence[Mapping[str, str]]) -> float:
    """Mean staleness of the pushes after every worker's first push: without start-up skew (workers
    joining one by one) and the first step's TensorFlow tracing, which make a few pushes very stale."""
    first: dict[str, float] = {}
    for p in pushes:
        t = _float(p.get("wall_time"))
        worker = str(p.get("worker"))
        first[worker] = min(first.get(worker, t), t)
    if not first:
        return math.nan
    ready = max(first.values())
    steady = [_float(p.get("staleness")) for p in pushes if _float(p.get("wall_time")) > ready]
    return sum(steady) / len(steady) if steady else math.nan


def run_metrics(run_dir: Path, target: Target | None = None) -> dict[str, float]:
    """The sweep's metrics of one finished run directory (NaN where a metric does not apply)."""
    s = load_summary(run_dir)
    pushes = read_csv(run_dir / "pushes.csv")
    wall_s = float(s.get("wall_s") or 0.0)
    accepted = sum(1 for p in pushes if p.get("accepted") == "1")
    shards = max(1, int(s.get("ps_shards") or 1))
    if pushes:
        dropped_pct = 100.0 * (len(pushes) - accepted) / len(pushes)
    else:
        applied, dropped = float(s.get("updates_applied", 0)), float(s.get("updates_dropped", 0))
        dropped_pct = 100.0 * dropped / (applied + dropped) if applied + dropped else 0.0
    idle = list((s.get("idle_fraction") or {}).values())
    stale = s.get("staleness") or {}
    final = s.get("final_eval") or {}
    reach_s, reach_updates = (time_to_target(read_csv(run_dir / "eval.csv"), target)
                              if target else (math.nan, math.nan))
    return {
        "updates": float(s.get("updates_applied", 0)),
        "wall_s": wall_s,
        "updates_per_s": float(s.get("throughput_updates_per_s", 0.0)),
        # a sync update averages a quorum of gradients: gradients/s compares the work done
        "gradients_per_s": accepted / shards / wall_s if wall_s > 0 else math.nan,
        "staleness_mean": _float(stale.get("mean")),
        "staleness_steady_mean": steady_staleness(pushes),
        "staleness_p95": _float(stale.get("p95")),
        "staleness_max": _float(stale.get("max")),
        "dropped_pct": dropped_pct,
        "idle_pct": 100.0 * sum(idle) / len(idle) if idle else math.nan,
        "time_to_target_s": reach_s,
        "updates_to_target": reach_updates,
        "final_accuracy": _float(final.get("accuracy")),
        "final_loss": _float(final.get("loss")),
        "optimality_gap": _float(s.get("optimality_gap")),
    }


# -- checks --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """One point's outcome as the checks see it: its settings and its metrics."""

    label: str
    settings: dict[str, Any]
    metrics: dict[str, float]

    def value(self, name: str) -> Any:
        """A metric, else a setting (KeyError if neither)."""
        if name in self.metrics:
            return self.metrics[name]
        return self.settings[name]

    def matches(self, where: Mapping[str, Any]) -> bool:
        """True when every `where` key has the given value (or one of the given list)."""
        return all(_any_equal(self.settings.get(k), v) for k, v in where.items())


def _any_equal(actual: Any, wanted: Any) -> bool:
    options = wanted if isinstance(wanted, list) else [wanted]
    return any(_equal(actual, w) for w in options)


def _equal(a: Any, b: Any) -> bool:
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) and not isinstance(b, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    return str(a) == str(b)


@dataclass(frozen=True)
class CheckOutcome:
    """A claim's verdict with the measured numbers that decided it."""

    name: str
    passed: bool
    detail: str
    why: str = ""

    def describe(self) -> str:
        """`PASS name: detail` (and the reason for the claim on the next line)."""
        text = f"{'PASS' if self.passed else 'FAIL'}  {self.name}: {self.detail}"
        return text + (f"\n      why: {self.why}" if self.why else "")


def _num(x: float) -> str:
    if math.isnan(x):
        return "n/a"
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"


@dataclass(frozen=True)
class Check(abc.ABC):
    """One expected outcome of a sweep, evaluated on its rows."""

    name: str
    metric: str
    where: dict[str, Any]
    why: str

    kind: ClassVar[str]

    def selected(self, rows: Sequence[Row], where: Mapping[str, Any] | None = None) -> list[Row]:
        """The rows the claim is about."""
        wanted = self.where if where is None else {**self.where, **where}
        return [r for r in rows if r.matches(wanted)]

    @abc.abstractmethod
    def evaluate(self, rows: Sequence[Row]) -> CheckOutcome:
        """PASS or FAIL, with the numbers."""

    def outcome(self, passed: bool, detail: str) -> CheckOutcome:
        """A CheckOutcome of this claim."""
        return CheckOutcome(self.name, passed, detail, " ".join(self.why.split()))


# A tiny arithmetic language for `expected`: numbers, names, + - * / ** and min/max/abs.
_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}
_FUNCTIONS: dict[str, Callable[..., float]] = {"min": min, "max": max, "abs": abs}


def evaluate_expression(text: str, names: Callable[[str], Any]) -> float:
    """Evaluate an arithmetic expression (no attribute access, no other calls)."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ExperimentError(f"bad expression {text!r}") from None

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return float(node.value)
        if isinstance(node, ast.Name):
            return float(names(node.id))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = ev(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](ev(node.left), ev(node.right))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
                and not node.keywords):
            return float(_FUNCTIONS[node.func.id](*(ev(a) for a in node.args)))
        raise ExperimentError(f"expression {text!r}: only numbers, names, + - * / ** and min/max/abs")

    return ev(tree)


@dataclass(frozen=True)
class Approx(Check):
    """Every selected row: |metric - expected| <= abs_tol + rel_tol * |expected|."""

    expected: str = "0"
    rel_tol: float = 0.0
    abs_tol: float = 0.0
    kind: ClassVar[str] = "approx"

    def evaluate(self, rows: Sequence[Row]) -> CheckOutcome:
        """Pass when every selected row is within tolerance."""
        selected = self.selected(rows)
        if not selected:
            return self.outcome(False, "no rows match " + json.dumps(self.where))
        parts, ok = [], True
        for row in selected:
            actual = float(row.value(self.metric))
            expected = evaluate_expression(self.expected, row.value)
            tol = self.abs_tol + self.rel_tol * abs(expected)
            good = abs(actual - expected) <= tol
            ok = ok and good
            parts.append(f"{row.label}: {_num(actual)} vs {_num(expected)} ± {_num(tol)}{'' if good else ' ✗'}")
        return self.outcome(ok, f"{self.metric} ≈ {self.expected}: " + "; ".join(parts))


_DIRECTIONS = ("increasing", "decreasing", "nondecreasing", "nonincreasing")


@dataclass(frozen=True)
class Trend(Check):
    """The metric, averaged per value of `by`, moves in one direction (with slack), by at least min_ratio."""

    by: str = "num_workers"
    direction: str = "increasing"
    abs_slack: float = 0.0
    rel_slack: float = 0.0
    min_ratio: float = 0.0
    kind: ClassVar[str] = "trend"

    def __post_init__(self) -> None:
        if self.direction not in _DIRECTIONS:
            raise ExperimentError(f"check {self.name}: direction must be one of {', '.join(_DIRECTIONS)}")

    def evaluate(self, rows: Sequence[Row]) -> CheckOutcome:
        """Pass when each neighbour pair and the end-to-end ratio agree with the direction."""
        groups: dict[float, list[float]] = {}
        for row in self.selected(rows):
            groups.setdefault(float(row.value(self.by)), []).append(float(row.value(self.metric)))
        if len(groups) < 2:
            return self.outcome(False, f"needs at least 2 values of {self.by}, got {len(groups)}")
        keys = sorted(groups)
        means = [sum(groups[k]) / len(groups[k]) for k in keys]
        shown = ", ".join(f"{_format_value(k) if not k.is_integer() else int(k)}: {_num(m)}"
                          for k, m in zip(keys, means, strict=True))
        detail = f"{self.metric} by {self.by} ({shown})"
        if any(math.isnan(m) for m in means):
            return self.outcome(False, detail + " — missing values (target not reached?)")
        up = self.direction in ("increasing", "nondecreasing")
        strict = self.direction in ("increasing", "decreasing")
        bad = []
        for (k0, m0), (k1, m1) in itertools.pairwise(zip(keys, means, strict=True)):
            slack = self.abs_slack + self.rel_slack * abs(m0)
            step = (m1 - m0) if up else (m0 - m1)
            if step < -slack or (strict and slack == 0 and step <= 0):
                bad.append(f"{_format_value(k0)}→{_format_value(k1)}")
        detail += f" {self.direction}"
        if self.abs_slack or self.rel_slack:
            parts = ([f"{_num(self.abs_slack)}"] if self.abs_slack else []) + (
                [f"{_num(self.rel_slack * 100)}%"] if self.rel_slack else [])
            detail += f" (slack {' + '.join(parts)})"
        ok = not bad
        if bad:
            detail += "; breaks at " + ", ".join(bad)
        if self.min_ratio:
            first, last = means[0], means[-1]
            ratio = (last / first if up else first / last) if (first if up else last) > 0 else math.inf
            detail += f"; {'last/first' if up else 'first/last'} {_num(ratio)} (need >= {_num(self.min_ratio)})"
            ok = ok and ratio >= self.min_ratio
        return self.outcome(ok, detail)


_OPS: dict[str, Callable[[float, float], bool]] = {
    "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
}
_AGGREGATES: dict[str, Callable[[list[float]], float]] = {
    "mean": lambda xs: sum(xs) / len(xs), "max": max, "min": min,
}


@dataclass(frozen=True)
class Compare(Check):
    """agg(left rows' metric) op factor * agg(right rows' metric)."""

    left: dict[str, Any] = field(default_factory=dict)
    right: dict[str, Any] = field(default_factory=dict)
    op: str = ">="
    factor: float = 1.0
    left_agg: str = "mean"
    right_agg: str = "mean"
    kind: ClassVar[str] = "compare"

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ExperimentError(f"check {self.name}: op must be one of {', '.join(_OPS)}")
        for agg in (self.left_agg, self.right_agg):
            if agg not in _AGGREGATES:
                raise ExperimentError(f"check {self.name}: aggregates are {', '.join(_AGGREGATES)}")

    def _side(self, rows: Sequence[Row], where: dict[str, Any], agg: str) -> tuple[float, str]:
        selected = self.selected(rows, where)
        if not selected:
            return math.nan, "no rows match " + json.dumps(where)
        values = [float(r.value(self.metric)) for r in selected]
        name = ", ".join(f"{k}={_format_value(v)}" for k, v in where.items())
        many = f"{agg} of {len(values)} " if len(values) > 1 else ""
        return _AGGREGATES[agg](values), f"{name}: {many}{_num(_AGGREGATES[agg](values))}"

    def evaluate(self, rows: Sequence[Row]) -> CheckOutcome:
        """Pass when the comparison holds (and both sides were measured)."""
        left, left_text = self._side(rows, self.left, self.left_agg)
        right, right_text = self._side(rows, self.right, self.right_agg)
        scale = f"{_num(self.factor)} * " if self.factor != 1 else ""
        detail = f"{self.metric} [{left_text}] {self.op} {scale}[{right_text}]"
        if math.isnan(left) or math.isnan(right):
            return self.outcome(False, detail + " — missing values")
        if right:
            detail += f" (ratio {_num(left / right)})"
        return self.outcome(_OPS[self.op](left, self.factor * right), detail)


_CHECK_KINDS: dict[str, type[Check]] = {c.kind: c for c in (Approx, Trend, Compare)}


def parse_check(data: Any, names: Iterable[str], index: int = 0) -> Check:
    """One claim of a spec's `check` list; `names` are the settings a `where` filter may name."""
    if not isinstance(data, dict) or "kind" not in data or "metric" not in data:
        raise ExperimentError(f"check {index}: a mapping with kind ({', '.join(_CHECK_KINDS)}) and metric")
    kind = _CHECK_KINDS.get(str(data["kind"]))
    if kind is None:
        raise ExperimentError(f"check {index}: unknown kind {data['kind']!r}; valid: {', '.join(_CHECK_KINDS)}")
    if data["metric"] not in METRICS:
        raise ExperimentError(f"check {index}: unknown metric {data['metric']!r}; valid: {', '.join(METRICS)}")
    known = set(names)
    filters = [data.get("where") or {}] + [data.get(k) or {} for k in ("left", "right")]
    for where in filters:
        if not isinstance(where, dict) or set(where) - known:
            raise ExperimentError(f"check {index}: filters name settings, axes or label; "
                                  f"unknown {sorted(set(where) - known) if isinstance(where, dict) else where}")
    if kind is Trend and data.get("by", "num_workers") not in known:
        raise ExperimentError(f"check {index}: by must name a setting")
    fields = {f.name for f in dataclasses.fields(kind)}
    args = {k: v for k, v in data.items() if k != "kind"}
    unknown = sorted(set(args) - fields)
    if unknown:
        raise ExperimentError(f"check {index} ({kind.kind}): unknown keys {unknown}; valid: {sorted(fields)}")
    args.setdefault("name", f"{kind.kind} {data['metric']}")
    args.setdefault("where", {})
    args.setdefault("why", "")
    if "expected" in args:
        args["expected"] = str(args["expected"])
    try:
        return kind(**args)
    except TypeError as exc:
        raise ExperimentError(f"check {index}: {exc}") from None


def evaluate_checks(checks: Sequence[Check], rows: Sequence[Row]) -> list[CheckOutcome]:
    """Every claim's verdict (a claim that cannot be evaluated fails, with the reason)."""
    outcomes = []
    for check in checks:
        try:
            outcomes.append(check.evaluate(rows))
        except (KeyError, ValueError, ZeroDivisionError) as exc:
            outcomes.append(check.outcome(False, f"could not evaluate: {exc!r}"))
    return outcomes


# -- the sweep -----------------------------------------------------------------------------------
Runner = Callable[[RunConfig, Path], int]


def run_local_quietly(run: RunConfig, run_dir: Path) -> int:
    """Run one local cluster with no live progress; the launcher's own lines go to run_dir/launcher.log."""
    from asyncps.tools.local import run_local

    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "launcher.log", "w") as log, contextlib.redirect_stdout(log):
        return run_local(run, run_dir, progress=False)


class SweepInterrupted(Exception):
    """The user stopped a point (Ctrl-C); finished points stay, the sweep resumes on the next call."""


@dataclass
class PointResult:
    """A point's outcome: its metrics (NaN where missing) and whether it ran, was resumed or failed."""

    point: Point
    status: str  # "ran", "resumed" or "failed"
    metrics: dict[str, float]

    def row(self) -> Row:
        """The point as the checks see it."""
        return Row(self.point.label, self.point.settings(), self.metrics)


def finished(run_dir: Path) -> bool:
    """True when the run directory holds the summary of a run that was not interrupted."""
    path = run_dir / "summary.json"
    if not path.exists():
        return False
    try:
        return load_summary(run_dir).get("stop_reason") != "interrupted"
    except (OSError, ValueError):
        return False


def _same_config(run_dir: Path, config: RunConfig) -> str | None:
    """None when run_dir/config.json was written for `config`, else the first difference."""
    path = run_dir / "config.json"
    if not path.exists():
        return None
    recorded = json.loads(path.read_text()).get("run", {})
    wanted = json.loads(config.to_json())
    for key in sorted(set(recorded) | set(wanted)):
        if recorded.get(key) != wanted.get(key):
            return f"{key}: {recorded.get(key)!r} there, {wanted.get(key)!r} in the spec"
    return None


def run_point(point: Point, out: Path, target: Target | None, runner: Runner) -> tuple[PointResult, bool]:
    """Run one point unless its directory already holds a finished run; (result, was it run now)."""
    run_dir = out / point.slug
    if finished(run_dir):
        difference = _same_config(run_dir, point.config)
        if difference:
            raise ExperimentError(f"{run_dir} holds a run of another configuration ({difference}); "
                                  "use another --out or delete it")
        return PointResult(point, "resumed", {**run_metrics(run_dir, target), "run_s": math.nan}), False
    if run_dir.exists():  # an unfinished run: start it over
        shutil.rmtree(run_dir)
    started = time.monotonic()
    code = runner(point.config, run_dir)
    run_s = time.monotonic() - started
    if (run_dir / "summary.json").exists() and not finished(run_dir):
        raise SweepInterrupted(point.label)
    if code != 0 or not (run_dir / "summary.json").exists():
        return PointResult(point, "failed", {**dict.fromkeys(METRICS, math.nan), "run_s": run_s}), True
    return PointResult(point, "ran", {**run_metrics(run_dir, target), "run_s": run_s}), True


def progress_line(n: int, total: int, result: PointResult) -> str:
    """One line per point: its label and headline numbers."""
    m = result.metrics
    head = f"[{n}/{total}] {result.point.label}: "
    if result.status == "failed":
        return head + f"FAILED after {m['run_s']:.0f}s (see {result.point.slug}/logs)"
    text = (f"{m['updates']:.0f} updates in {m['wall_s']:.1f}s ({m['updates_per_s']:.1f}/s), staleness "
            f"{m['staleness_mean']:.2f} (p95 {m['staleness_p95']:.0f}), dropped {m['dropped_pct']:.1f}%, "
            f"idle {m['idle_pct']:.1f}%")
    if not math.isnan(m["optimality_gap"]):
        text += f", gap {m['optimality_gap']:.4g}"
    else:
        text += f", acc {m['final_accuracy']:.3f}"
    if not math.isnan(m["updates_to_target"]):
        text += f", target at {m['updates_to_target']:.0f} updates / {m['time_to_target_s']:.1f}s"
    return head + text + (" (resumed)" if result.status == "resumed" else f" [{m['run_s']:.0f}s]")


@dataclass
class SweepResult:
    """Every point's result, the checks' verdicts and the sweep's wall time."""

    spec: ExperimentSpec
    results: list[PointResult]
    outcomes: list[CheckOutcome]
    sweep_s: float

    @property
    def passed(self) -> bool:
        """True when no point failed and every check passed."""
        return all(r.status != "failed" for r in self.results) and all(o.passed for o in self.outcomes)


def run_sweep(spec: ExperimentSpec, out: Path, runner: Runner = run_local_quietly,
              stream: IO[str] = sys.stdout) -> SweepResult:
    """Run (or resume) every point, write results.csv and results.md, evaluate the checks."""
    points = spec.points()
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results = []
    for n, point in enumerate(points, 1):
        result, _ = run_point(point, out, spec.target, runner)
        results.append(result)
        stream.write(progress_line(n, len(points), result) + "\n")
        stream.flush()
        write_results(SweepResult(spec, results, [], time.monotonic() - started), out)  # partial, if stopped
    outcomes = evaluate_checks(spec.checks, [r.row() for r in results if r.status != "failed"])
    sweep = SweepResult(spec, results, outcomes, time.monotonic() - started)
    write_results(sweep, out)
    return sweep


# -- results files -------------------------------------------------------------------------------
def results_columns(spec: ExperimentSpec) -> list[str]:
    """results.csv's header: point, label, one column per grid axis, status, then METRICS."""
    return ["point", "label", *spec.grid, "status", *METRICS]


def write_results(sweep: SweepResult, out: Path) -> None:
    """results.csv (every metric, empty where not measured) and results.md (a table and the checks)."""
    spec = sweep.spec
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(results_columns(spec))
        for r in sweep.results:
            metrics = ["" if math.isnan(r.metrics[k]) else f"{r.metrics[k]:.6g}" for k in METRICS]
            axes = [_format_value(r.point.axes[a]) for a in spec.grid]
            writer.writerow([r.point.slug, r.point.label, *axes, r.status, *metrics])
    (out / "results.md").write_text(results_markdown(sweep))


def _cell(x: float, spec: str = ".3g") -> str:
    return "—" if math.isnan(x) else format(x, spec)


def markdown_table(rows: Sequence[tuple[str, Mapping[str, float], bool]], target: Target | None) -> str:
    """(label, metrics, failed) rows as a markdown table (optimality gap instead of accuracy where measured)."""
    gap = any(not math.isnan(m["optimality_gap"]) for _, m, _ in rows)
    header = ["run", "updates/s", "grads/s", "staleness mean", "p95", "dropped %", "idle %"]
    if target:
        header += [f"time to {target.describe()} (s)", "updates to target"]
    header += ["updates", "optimality gap" if gap else "final accuracy"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, m, failed in rows:
        cells = [label + (" (failed)" if failed else ""), _cell(m["updates_per_s"], ".1f"),
                 _cell(m["gradients_per_s"], ".1f"), _cell(m["staleness_mean"], ".2f"),
                 _cell(m["staleness_p95"], ".0f"), _cell(m["dropped_pct"], ".1f"), _cell(m["idle_pct"], ".1f")]
        if target:
            cells += [_cell(m["time_to_target_s"], ".1f"), _cell(m["updates_to_target"], ".0f")]
        cells += [_cell(m["updates"], ".0f"),
                  _cell(m["optimality_gap"], ".4f") if gap else _cell(m["final_accuracy"], ".3f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def results_markdown(sweep: SweepResult) -> str:
    """results.md: what was swept, the table, and each check's verdict."""
    spec = sweep.spec
    ran = [r.metrics["run_s"] for r in sweep.results if r.status == "ran"]
    parts = [f"# {spec.name}\n"]
    if spec.description:
        parts.append(spec.description.strip() + "\n")
    base = ", ".join(f"{k}={_format_value(v)}" for k, v in spec.base.items())
    parts.append(f"Base: {base or 'defaults'}. Points: {len(sweep.results)}; this invocation took "
                 f"{sweep.sweep_s:.0f}s ({len(ran)} run, {len(sweep.results) - len(ran)} resumed).\n")
    parts.append(markdown_table([(r.point.label, r.metrics, r.status == "failed") for r in sweep.results],
                                spec.target))
    if sweep.outcomes:
        verdict = "PASS" if sweep.passed else "FAIL"
        parts.append(f"## Check: {verdict}\n")
        for o in sweep.outcomes:
            parts.append(f"- **{'PASS' if o.passed else 'FAIL'}** {o.name}: {o.detail}"
                         + (f"  \n  _why_: {o.why}" if o.why else ""))
        parts.append("")
    return "\n".join(parts)


# -- command line --------------------------------------------------------------------------------
def cmd_experiment(args: Any) -> int:
    """asyncps experiment SPEC [--out DIR] [--dry-run]: run the sweep, print the check; 1 on FAIL."""
    spec_path = Path(args.spec)
    spec = load_spec(spec_path)
    out = Path(args.out) if args.out else Path("runs") / spec.name
    points = spec.points()
    if args.dry_run:
        for p in points:
            state = "done" if finished(out / p.slug) else "to run"
            print(f"{p.slug}: {p.label} ({state})")
        return 0
    print(f"asyncps experiment {spec.name}: {len(points)} points -> {out}", flush=True)
    try:
        sweep = run_sweep(spec, out)
    except (SweepInterrupted, KeyboardInterrupt) as exc:
        where = f" at {exc}" if str(exc) else ""
        print(f"interrupted{where}; run the same command again to resume", file=sys.stderr)
        return 130
    print(f"results: {out / 'results.csv'}, {out / 'results.md'} ({sweep.sweep_s:.0f}s)")
    for outcome in sweep.outcomes:
        print(outcome.describe())
    failed = [r.point.label for r in sweep.results if r.status == "failed"]
    if failed:
        print(f"FAIL  points failed: {', '.join(failed)}")
    if sweep.outcomes or failed:
        print(f"check: {'PASS' if sweep.passed else 'FAIL'}")
    return 0 if sweep.passed else 1


def add_arguments(p: Any) -> None:
    """The `asyncps experiment` arguments."""
    p.add_argument("spec", help="YAML or TOML experiment spec (see experiments/)")
    p.add_argument("--out", default="", help="sweep directory (default: runs/<spec name>); finished points are kept")
    p.add_argument("--dry-run", action="store_true", help="list the points and whether they are done; run nothing")


__all__ = [
    "Check", "CheckOutcome", "ExperimentError", "ExperimentSpec", "Point", "PointResult", "Row", "Target",
    "cmd_experiment", "evaluate_checks", "expand_grid", "load_spec", "parse_spec", "run_metrics", "run_sweep",
]
