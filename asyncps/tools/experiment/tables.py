"""The sweep's results files: results.csv (written and read here) and results.md (a table and the checks)."""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncps.tools.experiment.errors import ExperimentError
from asyncps.tools.experiment.grid import format_value
from asyncps.tools.experiment.metrics import METRICS, Target
from asyncps.tools.experiment.tune import tune_markdown

if TYPE_CHECKING:
    from asyncps.tools.experiment.results import PointResult, SweepResult
    from asyncps.tools.experiment.spec import ExperimentSpec
    from asyncps.tools.experiment.tune import TuneChoice, TuneRun

RESULTS_CSV = "results.csv"
RESULTS_MD = "results.md"


TUNE_CSV = "tune.csv"


def tuned_column(spec: ExperimentSpec) -> list[str]:
    """results.csv's column of the chosen value, `tuned:PARAMETER` (none without a tune section)."""
    return [] if spec.tune is None else [f"tuned:{spec.tune.parameter}"]


def results_columns(spec: ExperimentSpec) -> list[str]:
    """results.csv's header: point, label, one column per grid axis, the tuned value (a spec with `tune`),
    status, then METRICS."""
    return ["point", "label", *spec.grid, *tuned_column(spec), "status", *METRICS]


def write_results(sweep: SweepResult, out: Path) -> None:
    """results.csv (every metric, empty where not measured) and results.md (a table and the checks)."""
    spec = sweep.spec
    with open(out / RESULTS_CSV, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(results_columns(spec))
        for r in sweep.results:
            metrics = ["" if math.isnan(r.metrics[k]) else f"{r.metrics[k]:.6g}" for k in METRICS]
            axes = [format_value(r.point.axes[a]) for a in spec.grid]
            tuned = [format_value(sweep.tuned[r.point.slug])] if spec.tune is not None else []
            writer.writerow([r.point.slug, r.point.label, *axes, *tuned, r.status, *metrics])
    (out / RESULTS_MD).write_text(results_markdown(sweep))


def write_tune_results(spec: ExperimentSpec, runs: Sequence[TuneRun], results: Sequence[PointResult],
                       choices: Sequence[TuneChoice], out: Path) -> None:
    """tune.csv: every tuning run (under tune/) so far: the choice it informs (the `per` axes), its candidate
    and seed, whether it was chosen (empty before the choice) and its metrics (evaluated on the validation
    split)."""
    if spec.tune is None:
        return
    tune = spec.tune
    chosen = {c.key: c.value for c in choices}
    with open(out / TUNE_CSV, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["point", "label", *tune.per, tune.parameter, "seed", "status", "chosen", *METRICS])
        for run, r in zip(runs, results, strict=False):
            metrics = ["" if math.isnan(r.metrics[k]) else f"{r.metrics[k]:.6g}" for k in METRICS]
            picked = "" if run.key not in chosen else str(int(chosen[run.key] == run.value))
            writer.writerow([r.point.slug, r.point.label, *(format_value(v) for _, v in run.key),
                             format_value(run.value), r.point.config.seed, r.status, picked, *metrics])


@dataclass(frozen=True)
class ResultRecord:
    """One row of results.csv read back: the point's directory, its label, its status and its metrics
    (NaN where the cell is empty; a metric an older results.csv lacks is NaN too)."""

    point: str
    label: str
    status: str
    metrics: dict[str, float]
    tuned: str = ""  # a tuned sweep's chosen value, `PARAMETER=VALUE` (its `tuned:PARAMETER` column)


def read_results(out: Path) -> dict[str, ResultRecord]:
    """A sweep directory's results.csv by point directory name (empty when there is none)."""
    path = out / RESULTS_CSV
    if not path.exists():
        return {}
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = sorted({"point", "label", "status"} - set(reader.fieldnames or ()))
        if missing:
            raise ExperimentError(f"{path}: no column(s) {missing}; not a results.csv of asyncps experiment")
        records = {}
        for row in reader:
            try:
                metrics = {k: float(row.get(k) or "nan") for k in METRICS}
            except ValueError as exc:
                raise ExperimentError(f"{path}:{reader.line_num}: {exc}") from None
            tuned = ", ".join(f"{k[len('tuned:'):]}={v}" for k, v in row.items() if k and k.startswith("tuned:") and v)
            records[row["point"]] = ResultRecord(row["point"], row["label"], row["status"], metrics, tuned)
    return records


def _cell(x: float, spec: str = ".3g") -> str:
    return "—" if math.isnan(x) else format(x, spec)


def markdown_table(rows: Sequence[tuple[str, Mapping[str, float], bool]], target: Target | None) -> str:
    """(label, metrics, failed) rows as a markdown table (optimality gap instead of accuracy where measured;
    the final test loss where no run measured accuracy: not a classification task)."""
    gap = any(not math.isnan(m["optimality_gap"]) for _, m, _ in rows)
    loss = not gap and bool(rows) and all(math.isnan(m["final_accuracy"]) for _, m, _ in rows)
    header = ["run", "updates/s", "grads/s", "staleness mean", "p95", "dropped %", "idle %"]
    if target:
        header += [f"time to {target.describe()} (s)", "updates to target"]
    header += ["updates", "optimality gap" if gap else "final loss" if loss else "final accuracy"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, m, failed in rows:
        cells = [label + (" (failed)" if failed else ""), _cell(m["updates_per_s"], ".1f"),
                 _cell(m["gradients_per_s"], ".1f"), _cell(m["staleness_mean"], ".2f"),
                 _cell(m["staleness_p95"], ".0f"), _cell(m["dropped_pct"], ".1f"), _cell(m["idle_pct"], ".1f")]
        if target:
            cells += [_cell(m["time_to_target_s"], ".1f"), _cell(m["updates_to_target"], ".0f")]
        cells += [_cell(m["updates"], ".0f"),
                  _cell(m["optimality_gap"], ".4f") if gap else _cell(m["final_loss"], ".4g") if loss
                  else _cell(m["final_accuracy"], ".3f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def results_markdown(sweep: SweepResult) -> str:
    """results.md: what was swept, the table, and each check's verdict."""
    spec = sweep.spec
    ran = [r.metrics["run_s"] for r in sweep.results if r.status == "ran"]
    parts = [f"# {spec.name}\n"]
    if spec.description:
        parts.append(spec.description.strip() + "\n")
    base = ", ".join(f"{k}={format_value(v)}" for k, v in spec.base.items())
    parts.append(f"Base: {base or 'defaults'}. Points: {len(sweep.results)}; this invocation took "
                 f"{sweep.sweep_s:.0f}s ({len(ran)} run, {len(sweep.results) - len(ran)} resumed).\n")
    if spec.tune is not None and sweep.choices:
        parts.append(tune_markdown(spec.tune, sweep.choices))
    parts.append(markdown_table([(r.point.label, r.metrics, r.status == "failed") for r in sweep.results],
                                spec.target))
    if "seed" in spec.grid:
        parts.append("Over seeds (mean ± standard deviation):\n")
        parts.append(seed_table(group_by_setting([(r.point.axes, r.metrics) for r in sweep.results
                                                  if r.status != "failed"])))
    if sweep.outcomes:
        verdict = "PASS" if sweep.passed else "FAIL"
        parts.append(f"## Check: {verdict}\n")
        for o in sweep.outcomes:
            parts.append(f"- **{'PASS' if o.passed else 'FAIL'}** {o.name}: {o.detail}"
                         + (f"  \n  _why_: {o.why}" if o.why else ""))
        parts.append("")
    return "\n".join(parts)


#: The metrics the seed table shows (columns where no point measured anything are left out).
SEED_METRICS: tuple[tuple[str, str, str], ...] = (
    ("updates_per_s", "updates/s", ".1f"), ("gradients_per_s", "grads/s", ".1f"),
    ("staleness_mean", "staleness mean", ".2f"), ("staleness_steady_mean", "steady staleness", ".2f"),
    ("idle_pct", "idle %", ".1f"), ("dropped_pct", "dropped %", ".1f"), ("clock_lead", "clock lead", ".0f"),
    ("time_to_target_s", "time to target (s)", ".2f"), ("updates_to_target", "updates to target", ".0f"),
    ("pushes_to_target", "pushes to target", ".0f"), ("optimality_gap", "optimality gap", ".4f"),
    ("final_accuracy", "final accuracy", ".3f"), ("final_loss", "final loss", ".3f"),
    ("row_staleness_mean", "row staleness", ".2f"), ("row_staleness_hot_mean", "hot rows' staleness", ".2f"),
    ("row_staleness_cold_mean", "cold rows' staleness", ".3f"), ("rows_dropped_pct", "rows dropped %", ".1f"),
    ("worker_mb", "MB per worker", ".0f"), ("run_s", "point s", ".0f"),
)


def _mean_spread(values: Sequence[float], fmt: str) -> str:
    """`mean ± sd` over seeds (the sample standard deviation; just the value for one seed)."""
    xs = [v for v in values if not math.isnan(v)]
    if not xs:
        return "—"
    mean = sum(xs) / len(xs)
    if len(xs) == 1:
        return format(mean, fmt)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
    return f"{format(mean, fmt)} ± {format(sd, fmt)}"


def seed_table(groups: Sequence[tuple[str, Sequence[Mapping[str, float]]]]) -> str:
    """One row per setting, every metric as mean ± standard deviation over its seeds (n in a column)."""
    shown = [m for m in SEED_METRICS if any(not math.isnan(r[m[0]]) for _, rows in groups for r in rows)]
    header = ["setting", "seeds", *(title for _, title, _ in shown)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, rows in groups:
        cells = [label, str(len(rows)), *(_mean_spread([r[k] for r in rows], fmt) for k, _, fmt in shown)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def group_by_setting(labelled: Sequence[tuple[Mapping[str, Any], Mapping[str, float]]]) -> list[
        tuple[str, list[Mapping[str, float]]]]:
    """(axes, metrics) per point -> (label without the seed, the metrics of each seed), in grid order."""
    groups: dict[str, list[Mapping[str, float]]] = {}
    for axes, metrics in labelled:
        label = ", ".join(v if isinstance(v, str) else f"{k}={format_value(v)}"
                          for k, v in axes.items() if k != "seed") or "base"
        groups.setdefault(label, []).append(metrics)
    return list(groups.items())
