"""`--stop-at METRIC>=V` / `METRIC<=V`: end a run once a scheduled evaluation meets a level.

Time-to-accuracy experiments (the staleness sweeps) need each run only until it reaches its target;
the run's other stop conditions still bound it when it never does. The metric is `loss`, `accuracy`
(classification) or a metric the task's evaluation reports by name (e.g. `mse`, `auc`)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

_SPEC = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(>=|<=)\s*([^\s]+)\s*$")
EXAMPLES = "accuracy>=0.9 or loss<=0.1"


@dataclass(frozen=True)
class StopAt:
    """Stop once `metric op value` holds for an evaluation."""

    metric: str
    op: str  # ">=" or "<="
    value: float

    def observed(self, loss: float, accuracy: float, metrics: Mapping[str, float]) -> float:
        """The evaluation's value of the metric; NaN when the evaluation does not report it."""
        if self.metric in metrics:
            return float(metrics[self.metric])
        if self.metric == "loss":
            return loss
        if self.metric == "accuracy":
            return accuracy
        return math.nan

    def met(self, loss: float, accuracy: float, metrics: Mapping[str, float]) -> bool:
        """True when an evaluation with these results meets the level (never on a value it lacks)."""
        value = self.observed(loss, accuracy, metrics)
        if math.isnan(value):
            return False
        return value >= self.value if self.op == ">=" else value <= self.value

    def describe(self) -> str:
        """E.g. `accuracy >= 0.9`."""
        return f"{self.metric} {self.op} {self.value:g}"


def parse_stop_at(text: str) -> StopAt | None:
    """`accuracy>=0.9` -> StopAt; "" -> None; anything else a ValueError that says what is wrong."""
    if not text.strip():
        return None
    match = _SPEC.match(text)
    if match is None:
        raise ValueError(f"stop_at {text!r} is not METRIC>=VALUE or METRIC<=VALUE (e.g. {EXAMPLES})")
    metric, op, number = match.groups()
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"stop_at {text!r}: {number!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"stop_at {text!r}: the level must be a finite number")
    return StopAt(metric, op, value)
