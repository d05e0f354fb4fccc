"""Checks: the expected outcome of a sweep (approx, bound, trend, compare, closer claims) and their verdicts."""

from __future__ import annotations

import abc
import dataclasses
import itertools
import json
import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from asyncps.tools.experiment.errors import ExperimentError
from asyncps.tools.experiment.expr import evaluate_expression
from asyncps.tools.experiment.grid import format_value
from asyncps.tools.experiment.metrics import METRICS, TO_TARGET_METRICS


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
    if math.isinf(x):
        return "∞" if x > 0 else "-∞"
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

    def every_row(self, rows: Sequence[Row], claim: str, expected: str,
                  judge: Callable[[float, float], tuple[bool, str]]) -> CheckOutcome:
        """PASS when `judge(actual, expected)` holds for every selected row, `expected` an expression
        over the row (none selected: FAIL); `judge` also gives the row's numbers for the detail."""
        selected = self.selected(rows)
        if not selected:
            return self.outcome(False, "no rows match " + json.dumps(self.where))
        parts, ok = [], True
        for row in selected:
            good, numbers = judge(float(row.value(self.metric)),
                                  evaluate_expression(expected, row.value))
            ok = ok and good
            parts.append(f"{row.label}: {numbers}{'' if good else ' ✗'}")
        return self.outcome(ok, f"{claim}: " + "; ".join(parts))


@dataclass(frozen=True)
class Approx(Check):
    """Every selected row: |metric - expected| <= abs_tol + rel_tol * |expected|."""

    expected: str = "0"
    rel_tol: float = 0.0
    abs_tol: float = 0.0
    kind: ClassVar[str] = "approx"

    def evaluate(self, rows: Sequence[Row]) -> CheckOutcome:
        """Pass when every selected row is within tolerance."""

        def judge(actual: float, expected: float) -> tuple[bool, str]:
            tol = self.abs_tol + self.rel_tol * abs(expected)
            return abs(actual - expected) <= tol, f"{_num(actual)} vs {_num(expected)} ± {_num(tol)}"

        return self.every_row(rows, f"{self.metric} ≈ {self.expected}", self.expected, judge)


@dataclass(frozen=True)
class Bound(Check):
    """Every selected row: metric op expected (an expression over the row), e.g. clock_lead <= s."""

    expected: str = "0"
    op: str = "<="
    kind: ClassVar[str] = "bound"

    def __post_init__(self) -> None:
        if self.op not in _BOUND_OPS:
            raise ExperimentError(f"check {self.name}: op must be one of {', '.join(_BOUND_OPS)}")

    def evaluate(self, rows: Sequence[Row]) -> CheckOutcome:
        """Pass when every selected row holds the bound (a missing value fails)."""

        def judge(actual: float, expected: float) -> tuple[bool, str]:
            return not math.isnan(actual) and _BOUND_OPS[self.op](actual, expected), _num(actual)

        return self.every_row(rows, f"{self.metric} {self.op} {self.expected}", self.expected, judge)


_BOUND_OPS: dict[str, Callable[[float, float], bool]] = {
    "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
}
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
        shown = ", ".join(f"{format_value(k) if not k.is_integer() else int(k)}: {_num(m)}"
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
                bad.append(f"{format_value(k0)}→{format_value(k1)}")
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
    """agg(left rows' metric) op factor * agg(right rows' metric). With `normalize` (settings, e.g.
    {staleness: "λ=1"}) each side is divided by the same aggregate over its rows with those settings
    in place: a normalized cost, e.g. updates to the target at λ over those at λ = 1 (Dai et al. 2019).

    A run that never reached the target (a *_to_target metric) costs more than any measured value: it
    counts as infinite, so that side's mean is infinite and the detail says how many never reached it.
    Both sides infinite, or a baseline that never reached it, is no claim: FAIL."""

    left: dict[str, Any] = field(default_factory=dict)
    right: dict[str, Any] = field(default_factory=dict)
    op: str = ">="
    factor: float = 1.0
    left_agg: str = "mean"
    right_agg: str = "mean"
    normalize: dict[str, Any] = field(default_factory=dict)
    kind: ClassVar[str] = "compare"

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ExperimentError(f"check {self.name}: op must be one of {', '.join(_OPS)}")
        for agg in (self.left_agg, self.right_agg):
            if agg not in _AGGREGATES:
                raise ExperimentError(f"check {self.name}: aggregates are {', '.join(_AGGREGATES)}")

    def _side(self, rows: Sequence[Row], where: dict[str, Any], agg: str) -> tuple[float, str]:
        value, text = self._aggregate(rows, where, agg)
        if not self.normalize or math.isnan(value):
            return value, text
        base, base_text = self._aggregate(rows, {**where, **self.normalize}, agg)
        if math.isnan(base) or math.isinf(base) or base <= 0:
            return math.nan, f"{text} / [{base_text}]: no positive baseline"
        return value / base, f"{text} / [{base_text}] = {_num(value / base)}"

    def _aggregate(self, rows: Sequence[Row], where: dict[str, Any], agg: str) -> tuple[float, str]:
        selected = self.selected(rows, where)
        if not selected:
            return math.nan, "no rows match " + json.dumps(where, ensure_ascii=False)
        values = [float(r.value(self.metric)) for r in selected]
        unreached = ""
        if self.metric in TO_TARGET_METRICS:
            never = sum(math.isnan(v) for v in values)
            values = [math.inf if math.isnan(v) else v for v in values]
            unreached = f" ({never} of {len(values)} never reached it)" if never else ""
        name = ", ".join(f"{k}={format_value(v)}" for k, v in where.items())
        many = f"{agg} of {len(values)} " if len(values) > 1 else ""
        return _AGGREGATES[agg](values), f"{name}: {many}{_num(_AGGREGATES[agg](values))}{unreached}"

    def evaluate(self, rows: Sequence[Row]) -> CheckOutcome:
        """Pass when the comparison holds (and both sides were measured, not both never reached)."""
        left, left_text = self._side(rows, self.left, self.left_agg)
        right, right_text = self._side(rows, self.right, self.right_agg)
        scale = f"{_num(self.factor)} * " if self.factor != 1 else ""
        detail = f"{self.metric} [{left_text}] {self.op} {scale}[{right_text}]"
        if math.isnan(left) or math.isnan(right):
            return self.outcome(False, detail + " — missing values")
        if math.isinf(left) and math.isinf(right):
            return self.outcome(False, detail + " — neither side reached the target")
        if right and math.isfinite(left) and math.isfinite(right):
            detail += f" (ratio {_num(left / right)})"
        return self.outcome(_OPS[self.op](left, self.factor * right), detail)


@dataclass(frozen=True)
class Closer(Check):
    """|agg(left) - agg(reference)| < factor * |agg(right) - agg(reference)|: the left rows land closer
    to the reference than the right rows do (e.g. updates to a target: which run recovers the
    reference's curve). A right side that never reached (NaN) is farther than any measured value;
    a left or reference side without a value fails."""

    left: dict[str, Any] = field(default_factory=dict)
    right: dict[str, Any] = field(default_factory=dict)
    reference: dict[str, Any] = field(default_factory=dict)
    factor: float = 1.0
    kind: ClassVar[str] = "closer"

    def _mean(self, rows: Sequence[Row], where: dict[str, Any]) -> tuple[float, str]:
        selected = self.selected(rows, where)
        name = ", ".join(f"{k}={format_value(v)}" for k, v in where.items())
        if not selected:
            return math.nan, f"{name}: no rows"
        values = [float(r.value(self.metric)) for r in selected]
        mean = math.nan if any(math.isnan(v) for v in values) else sum(values) / len(values)
        many = f"mean of {len(values)} " if len(values) > 1 else ""
        return mean, f"{name}: {many}{_num(mean) if not math.isnan(mean) else 'never reached'}"

    def evaluate(self, rows: Sequence[Row]) -> CheckOutcome:
        """Pass when the left side is closer to the reference (both of them measured)."""
        ref, ref_text = self._mean(rows, self.reference)
        left, left_text = self._mean(rows, self.left)
        right, right_text = self._mean(rows, self.right)
        scale = f"{_num(self.factor)} * " if self.factor != 1 else ""
        near = abs(left - ref)
        far = math.inf if math.isnan(right) else abs(right - ref)
        detail = (f"{self.metric}: |[{left_text}] - [{ref_text}]| = {_num(near)} < {scale}"
                  f"|[{right_text}] - ref| = {_num(far) if math.isfinite(far) else '∞'}")
        if math.isnan(ref) or math.isnan(left):
            return self.outcome(False, detail + " — missing values")
        return self.outcome(near < self.factor * far, detail)


_CHECK_KINDS: dict[str, type[Check]] = {c.kind: c for c in (Approx, Trend, Compare, Bound, Closer)}


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
    filters = [data.get("where") or {}] + [data.get(k) or {} for k in ("left", "right", "reference", "normalize")]
    for where in filters:
        if not isinstance(where, dict) or set(where) - known:
            raise ExperimentError(f"check {index}: filters name settings, axes or label; "
                                  f"unknown {sorted(set(where) - known) if isinstance(where, dict) else where}")
    if kind is Trend and data.get("by", "num_workers") not in known:
        raise ExperimentError(f"check {index}: by must name a setting")
    full_only = data.get("full_only")
    if full_only is not None and (not isinstance(full_only, str) or not full_only.strip()):
        raise ExperimentError(f"check {index}: full_only gives the reason the reduced run leaves the claim out")
    fields = {f.name for f in dataclasses.fields(kind)}
    args = {k: v for k, v in data.items() if k not in ("kind", "full_only")}
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
