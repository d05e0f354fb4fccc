"""One run's metrics: read from its run directory through the core's run-directory types."""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from asyncps.rundir import (
    EvalRow,
    PeakMemory,
    PushRow,
    RunConfigRecord,
    RunDir,
    RunSummary,
    StepRow,
    load_summary,
    read_rows,
)
from asyncps.tools.experiment.errors import ExperimentError

#: The metrics of every point, in results.csv order; checks and targets refer to them by name.
METRICS: tuple[str, ...] = (
    "updates", "wall_s", "updates_per_s", "gradients_per_s", "staleness_mean", "staleness_steady_mean",
    "staleness_p95", "staleness_max", "dropped_pct", "idle_pct", "time_to_target_s", "updates_to_target",
    "final_accuracy", "final_loss", "optimality_gap", "clock_lead", "late_workers", "worker_mb", "loss_rebound",
    "run_s", "gap_tail", "pushes_to_target", "row_staleness_mean", "row_staleness_hot_mean",
    "row_staleness_cold_mean", "rows_dropped_pct",
)

#: The metrics measured up to the target: NaN when the run never reached it, a cost above any measured
#: value rather than a missing one (a compare check counts it as infinite).
TO_TARGET_METRICS = frozenset({"time_to_target_s", "updates_to_target", "pushes_to_target"})


#: What a target may name: the test accuracy, the test loss, or the test loss above the one the
#: exact optimum reaches on the same data (synthetic-logreg only; its data, and so its attainable
#: loss, change with the seed, so a fixed loss level would be far for one seed and unreachable for
#: another).
TARGET_METRICS = ("accuracy", "loss", "excess_loss")


@dataclass(frozen=True)
class Target:
    """An evaluation level to reach: accuracy at least `value`, or (excess) loss at most `value`."""

    metric: str
    value: float

    def __post_init__(self) -> None:
        if self.metric not in TARGET_METRICS:
            raise ExperimentError(f"target metric must be one of {', '.join(TARGET_METRICS)}, got {self.metric!r}")
        if not math.isfinite(self.value):
            raise ExperimentError(f"target value must be a finite number, got {self.value!r}")

    def reached(self, loss: float, accuracy: float) -> bool:
        """True when an evaluation with this loss and accuracy meets the target."""
        return accuracy >= self.value if self.metric == "accuracy" else loss <= self.value

    def describe(self) -> str:
        """E.g. `accuracy >= 0.9`."""
        return f"{self.metric} {'>=' if self.metric == 'accuracy' else '<='} {self.value:g}"


def time_to_target(evals: Sequence[EvalRow], target: Target) -> tuple[float, float]:
    """(seconds, updates) at which the evaluations first meet the target; NaN, NaN if they never do.

    Linearly interpolated between the last evaluation short of the target and the first that meets
    it: evaluations are ~0.3-1 s apart, too coarse on their own to compare runs a few updates apart.
    """
    previous: tuple[float, float, float] | None = None
    for row in evals:
        elapsed, updates = row.elapsed_s, float(row.updates)
        value = row.accuracy if target.metric == "accuracy" else row.loss  # excess_loss: already offset
        if target.reached(row.loss, row.accuracy):
            if previous is None or value == previous[2] or math.isnan(previous[2]):
                return elapsed, updates
            frac = min(1.0, max(0.0, (target.value - previous[2]) / (value - previous[2])))
            return (previous[0] + frac * (elapsed - previous[0]), previous[1] + frac * (updates - previous[1]))
        previous = (elapsed, updates, value)
    return math.nan, math.nan


def pushes_to_target(updates_to_target: float, pushes: int, shards: int, updates: int) -> float:
    """The pushes (rounds of communication: gradients, or local SGD's deltas) per shard that the
    run's updates to the target stand for: updates_to_target times the run's pushes per update. Unlike
    updates it counts a sync step's n pushes as n, so sync and async runs compare by what they sent."""
    if math.isnan(updates_to_target) or updates <= 0:
        return math.nan
    return updates_to_target * pushes / max(1, shards) / updates


def loss_rebound(evals: Sequence[EvalRow]) -> float:
    """The largest rise of the test loss above its lowest value so far: how far a run climbs back
    after it has come down, i.e. its overshoot (momentum, implicit or explicit, overshoots; plain
    noisy descent wobbles by its noise only). NaN with fewer than two evaluations."""
    if len(evals) < 2:
        return math.nan
    lowest, rise = math.inf, 0.0
    for row in evals:
        lowest = min(lowest, row.loss)
        rise = max(rise, row.loss - lowest)
    return rise


#: The share of a run, by applied updates, over which gap_tail averages.
TAIL_FRACTION = 0.5


def gap_tail(evals: Sequence[EvalRow], floor: float, fraction: float = TAIL_FRACTION) -> float:
    """The mean test loss above `floor` (the optimum's) over the evaluations in the last `fraction`
    of the run's updates. At a learning rate large enough for staleness to matter, SGD keeps
    wandering around the optimum, so the final gap is one sample of a fluctuating quantity; the
    mean over the tail estimates the level the run settled at, with a smaller spread."""
    if not evals:
        return math.nan
    last = max(row.updates for row in evals)
    tail = [row.loss - floor for row in evals if row.updates >= (1.0 - fraction) * last]
    return sum(tail) / len(tail)


def steady_staleness(pushes: Sequence[PushRow]) -> float:
    """Mean staleness of the pushes after every worker's first push: without start-up skew (workers
    joining one by one) and the first step's TensorFlow tracing, which make a few pushes very stale."""
    first: dict[int, float] = {}
    for p in pushes:
        first[p.worker] = min(first.get(p.worker, p.wall_time), p.wall_time)
    if not first:
        return math.nan
    ready = max(first.values())
    steady = [p.staleness for p in pushes if p.wall_time > ready]
    return sum(steady) / len(steady) if steady else math.nan


def start_lead(steps: Sequence[StepRow]) -> float:
    """The largest clock lead seen at a step start, from timeline.csv: when a worker starts step k it
    has pushed k - 1 times, and another worker still running has pushed at most the steps it has
    started, so (k - 1) - (fewest steps started by another running worker) is a lower bound of the
    true lead: above the SSP bound s it proves a violation. Independent of the shards' own clocks."""
    starts: dict[int, list[float]] = {}
    for row in steps:
        starts.setdefault(row.worker, []).append(row.start)
    for times in starts.values():
        times.sort()
    lead = 0
    for worker, times in starts.items():
        for k, t in enumerate(times, start=1):
            others = [bisect.bisect_right(o, t) for u, o in starts.items() if u != worker and o[0] <= t < o[-1]]
            if others:
                lead = max(lead, (k - 1) - min(others))
    return float(lead)


def clock_lead(run_dir: Path) -> float:
    """The run's largest clock lead measured independently of the shards: summary.json's
    `measured_clock_lead` where the chief wrote one (from pushes.csv), else start_lead of timeline.csv."""
    files = RunDir(run_dir)
    # an unfinished or crashed run (asyncps report reads those too) has no summary.json yet
    measured = RunSummary.load(run_dir).measured_clock_lead if files.summary.exists() else None
    if measured is not None:
        return float(measured)
    return start_lead(read_rows(files.timeline, StepRow)) if files.timeline.exists() else math.nan


def worker_mb(run_dir: Path) -> float:
    """Peak resident memory per (logical) worker from memory.json (NaN when the launcher wrote none)."""
    memory = PeakMemory.load_if_present(run_dir)
    return memory.per_worker_mb if memory is not None else math.nan


def optimal_test_loss(run_dir: Path) -> float:
    """The test loss of the exact optimum of the run's synthetic-logreg data (from its config.json)."""
    from asyncps.ml.datasets import binary_cross_entropy, load_dataset, logreg_optimum

    record = RunConfigRecord.load_if_present(run_dir)
    if record is None or record.run.get("dataset") != "synthetic-logreg":
        raise ExperimentError(f"{run_dir}: an excess_loss target needs a synthetic-logreg run (its config.json)")
    data = load_dataset("synthetic-logreg", int(record.run.get("seed", 0)))
    w, b, _ = logreg_optimum(data.x_train, data.y_train)
    return binary_cross_entropy(data.x_test, data.y_test, w, b)


def excess(evals: Sequence[EvalRow], floor: float) -> list[EvalRow]:
    """The evaluations with `floor` taken off their loss."""
    return [dataclasses.replace(row, loss=row.loss - floor) for row in evals]


def run_metrics(run_dir: Path, target: Target | None = None) -> dict[str, float]:
    """The sweep's metrics of one finished run directory (NaN where a metric does not apply)."""
    s = load_summary(run_dir)
    pushes = read_rows(RunDir(run_dir).pushes, PushRow)
    accepted = sum(1 for p in pushes if p.accepted)
    shards = max(1, s.ps_shards)
    if pushes:
        dropped_pct = 100.0 * (len(pushes) - accepted) / len(pushes)
    else:
        applied, dropped = s.updates_applied, s.updates_dropped
        dropped_pct = 100.0 * dropped / (applied + dropped) if applied + dropped else 0.0
    reach_s, reach_updates, reach_pushes = math.nan, math.nan, math.nan
    evals = read_rows(RunDir(run_dir).evals, EvalRow) if RunDir(run_dir).evals.exists() else []
    floor = optimal_test_loss(run_dir) if s.optimality_gap is not None and evals else math.nan
    if target:
        if target.metric == "excess_loss":
            evals = excess(evals, optimal_test_loss(run_dir) if math.isnan(floor) else floor)
            floor = 0.0
        reach_s, reach_updates = time_to_target(evals, target)
        reach_pushes = pushes_to_target(reach_updates, len(pushes), shards, s.updates_applied)
    return {
        "updates": float(s.updates_applied),
        "wall_s": s.wall_s,
        "updates_per_s": s.throughput_updates_per_s,
        # a sync update averages a quorum of gradients: gradients/s compares the work done
        "gradients_per_s": accepted / shards / s.wall_s if s.wall_s > 0 else math.nan,
        "staleness_mean": s.staleness.mean,
        # the chief's figure (pushes after every planned worker's first push), else from pushes.csv
        "staleness_steady_mean": (s.staleness_steady.mean if s.staleness_steady is not None
                                  else steady_staleness(pushes)),
        "staleness_p95": float(s.staleness.p95),
        "staleness_max": float(s.staleness.max),
        "dropped_pct": dropped_pct,
        "idle_pct": 100.0 * s.mean_idle_fraction(),
        "time_to_target_s": reach_s,
        "updates_to_target": reach_updates,
        "final_accuracy": s.final_eval.accuracy,
        "final_loss": s.final_eval.loss,
        "optimality_gap": math.nan if s.optimality_gap is None else s.optimality_gap,
        "clock_lead": clock_lead(run_dir),
        "late_workers": float(len(s.start["late_workers"])) if isinstance(s.start.get("late_workers"), list)
        else math.nan,
        "worker_mb": worker_mb(run_dir),
        "loss_rebound": loss_rebound(evals),
        "gap_tail": math.nan if math.isnan(floor) else gap_tail(evals, floor),
        "pushes_to_target": reach_pushes,
        **row_metrics(s),
    }


def row_metrics(s: RunSummary) -> dict[str, float]:
    """Per-row staleness (tables read by rows): every row's mean, the hot rows' and the others', and the
    percentage of rows a per-row policy dropped; NaN when no push measured any."""
    rows = s.row_staleness
    if rows is None:
        return dict.fromkeys(("row_staleness_mean", "row_staleness_hot_mean", "row_staleness_cold_mean",
                              "rows_dropped_pct"), math.nan)
    return {"row_staleness_mean": rows.mean,
            "row_staleness_hot_mean": rows.hot_mean if rows.hot_rows else math.nan,
            "row_staleness_cold_mean": rows.cold_mean if rows.rows > rows.hot_rows else math.nan,
            "rows_dropped_pct": 100.0 * rows.dropped / rows.rows}
