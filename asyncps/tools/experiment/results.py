"""A sweep's results as data: each point's outcome and the sweep's verdict (written by tables.py,
produced by sweep.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncps.tools.experiment.checks import CheckOutcome, Row
from asyncps.tools.experiment.grid import Point
from asyncps.tools.experiment.spec import ExperimentSpec
from asyncps.tools.experiment.tune import TuneChoice


@dataclass
class PointResult:
    """A point's outcome: its metrics (NaN where missing) and whether it ran, was resumed or failed."""

    point: Point
    status: str  # "ran", "resumed" or "failed"
    metrics: dict[str, float]

    def row(self) -> Row:
        """The point as the checks see it."""
        return Row(self.point.label, self.point.settings(), self.metrics)


@dataclass
class SweepResult:
    """Every point's result, the checks' verdicts and the sweep's wall time."""

    spec: ExperimentSpec
    results: list[PointResult]
    outcomes: list[CheckOutcome]
    sweep_s: float
    choices: list[TuneChoice] = field(default_factory=list)  # the tuning's choices (a spec with `tune`)
    tuned: dict[str, float] = field(default_factory=dict)  # the chosen value by measured point slug

    @property
    def passed(self) -> bool:
        """True when no point failed and every check passed."""
        return all(r.status != "failed" for r in self.results) and all(o.passed for o in self.outcomes)


__all__ = ["PointResult", "SweepResult"]
