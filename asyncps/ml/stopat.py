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


_EARLY = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?::\s*(.*))?$")
EARLY_EXAMPLES = "val_loss:patience=3 or accuracy:patience=5,min_delta=0.001,mode=max"


@dataclass(frozen=True)
class EarlyStop:
    """`--early-stop METRIC:patience=P[,min_delta=D][,mode=min|max]`: stop once P evaluations in a row did not
    improve METRIC by more than D over its best (Keras' EarlyStopping, on the chief's evaluations). METRIC:
    as StopAt's, a `val_` prefix allowed (Keras' name for the same evaluation on held-out data); mode auto:
    max for accuracies and AUC, min otherwise."""

    metric: str
    patience: int
    min_delta: float = 0.0
    mode: str = "min"

    def improved(self, value: float, best: float) -> bool:
        """Whether `value` improves on `best` by more than min_delta."""
        if math.isnan(best):
            return not math.isnan(value)
        return value < best - self.min_delta if self.mode == "min" else value > best + self.min_delta

    def describe(self) -> str:
        """E.g. `loss did not improve for 3 evaluations`."""
        return f"{self.metric} did not improve by more than {self.min_delta:g} for {self.patience} evaluations"


class EarlyStopWatch:
    """Follows one run's evaluations against an EarlyStop: whether the run should end."""

    def __init__(self, rule: EarlyStop) -> None:
        self.rule = rule
        self.best = math.nan
        self.waited = 0

    def observe(self, loss: float, accuracy: float, metrics: Mapping[str, float]) -> bool:
        """Take one evaluation; True once the rule says stop (an evaluation without the metric counts as none)."""
        value = StopAt(self.rule.metric, "<=", 0.0).observed(loss, accuracy, metrics)
        if math.isnan(value):
            return False
        if self.rule.improved(value, self.best):
            self.best, self.waited = value, 0
            return False
        self.waited += 1
        return self.waited >= self.rule.patience


def parse_early_stop(text: str) -> EarlyStop | None:
    """`val_loss:patience=3` -> EarlyStop; "" -> None; anything else a ValueError that says what is wrong."""
    if not text.strip():
        return None
    match = _EARLY.match(text)
    if match is None:
        raise ValueError(f"early_stop {text!r} is not METRIC:patience=P[,min_delta=D][,mode=min|max] "
                         f"(e.g. {EARLY_EXAMPLES})")
    metric, rest = match.group(1), match.group(2) or ""
    metric = metric[4:] if metric.startswith("val_") else metric
    params: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in ("patience", "min_delta", "mode"):
            raise ValueError(f"early_stop {text!r}: unknown parameter {item!r} (patience, min_delta, mode)")
        params[key] = value.strip()
    try:
        patience = int(params.get("patience", "1"))
        min_delta = abs(float(params.get("min_delta", "0")))
    except ValueError:
        raise ValueError(f"early_stop {text!r}: patience is a whole number, min_delta a number") from None
    if patience < 1 or not math.isfinite(min_delta):
        raise ValueError(f"early_stop {text!r}: patience must be >= 1 and min_delta finite")
    mode = params.get("mode", "auto")
    if mode == "auto":
        mode = "max" if metric.endswith(("accuracy", "acc", "auc")) else "min"
    if mode not in ("min", "max"):
        raise ValueError(f"early_stop {text!r}: mode is min, max or auto")
    return EarlyStop(metric, patience, min_delta, mode)
