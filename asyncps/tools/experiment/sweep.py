"""The sweep: run (or resume) every point as a local cluster, collect metrics, evaluate the checks."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING

from asyncps.config import RunConfig
from asyncps.rundir import RunConfigRecord, RunDir, RunSummary
from asyncps.tools.experiment.checks import evaluate_checks
from asyncps.tools.experiment.errors import ExperimentError
from asyncps.tools.experiment.grid import Point
from asyncps.tools.experiment.metrics import METRICS, Target, run_metrics
from asyncps.tools.experiment.results import PointResult, SweepResult
from asyncps.tools.experiment.spec import ExperimentSpec
from asyncps.tools.experiment.tables import read_results, write_results, write_tune_results
from asyncps.tools.experiment.tune import TuneChoice, choose, tune_runs
from asyncps.tools.progress import SweepProgress

if TYPE_CHECKING:
    from asyncps.tools.progress import StatusSink

Runner = Callable[[RunConfig, Path], int]


def run_local_quietly(run: RunConfig, run_dir: Path, sink: StatusSink | None = None) -> int:
    """Run one local cluster, its status to `sink` (if any); the launcher's own lines go to
    run_dir/launcher.log."""
    from asyncps.tools.local import run_local

    run_dir.mkdir(parents=True, exist_ok=True)
    with open(RunDir(run_dir).launcher_log, "w") as log, contextlib.redirect_stdout(log):
        return run_local(run, run_dir, progress=False, sink=sink)


class SweepInterrupted(Exception):
    """The user stopped a point (Ctrl-C); finished points stay, the sweep resumes on the next call."""


def finished(run_dir: Path) -> bool:
    """True when the run directory holds the summary of a run that was not interrupted.

    A summary.json that does not read is a RunDirError (naming the file and the field), not an
    unfinished run: the point is not deleted and re-run behind the user's back."""
    if not RunDir(run_dir).summary.exists():
        return False
    return not RunSummary.load(run_dir).interrupted


def _same_config(run_dir: Path, config: RunConfig) -> str | None:
    """None when run_dir/config.json was written for `config`, else the first difference."""
    record = RunConfigRecord.load_if_present(run_dir)
    if record is None:
        return None
    recorded = record.run
    wanted = json.loads(config.to_json())
    for key in sorted(set(recorded) | set(wanted)):
        if recorded.get(key) != wanted.get(key):
            return f"{key}: {recorded.get(key)!r} there, {wanted.get(key)!r} in the spec"
    return None


def run_point(point: Point, out: Path, target: Target | None, runner: Runner,
              recorded_run_s: float = math.nan) -> tuple[PointResult, bool]:
    """Run one point unless its directory already holds a finished run; (result, was it run now).
    A resumed point keeps `recorded_run_s`, its wall time in the results.csv it was run for."""
    run_dir = out / point.slug
    if finished(run_dir):
        difference = _same_config(run_dir, point.config)
        if difference:
            raise ExperimentError(f"{run_dir} holds a run of another configuration ({difference}); "
                                  "use another --out or delete it")
        return PointResult(point, "resumed", {**run_metrics(run_dir, target), "run_s": recorded_run_s}), False
    if run_dir.exists():  # an unfinished run: start it over
        shutil.rmtree(run_dir)
    started = time.monotonic()
    code = runner(point.config, run_dir)
    run_s = time.monotonic() - started
    summary = RunDir(run_dir).summary
    if summary.exists() and not finished(run_dir):
        raise SweepInterrupted(point.label)
    if code != 0 or not summary.exists():
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


#: the tuning runs' directory inside a sweep's
TUNE_DIR = "tune"


def run_tuning(spec: ExperimentSpec, out: Path, runner: Runner | None = None,
               stream: IO[str] = sys.stdout) -> list[TuneChoice]:
    """Run (or resume) the tuning runs of a spec with a `tune` section under OUT/tune/, write OUT/tune.csv
    and return the choices (see asyncps.tools.experiment.tune); none without a tune section."""
    if spec.tune is None:
        return []
    runs = tune_runs(spec.tune, spec.base, spec.grid)
    tune_dir = out / TUNE_DIR
    tune_dir.mkdir(parents=True, exist_ok=True)
    display = SweepProgress(sum(not finished(tune_dir / r.point.slug) for r in runs), len(runs), stream)
    results: list[PointResult] = []
    try:
        for n, run in enumerate(runs, 1):
            sink = display.point(n, "tune: " + run.point.label)
            point_runner = runner or functools.partial(run_local_quietly, sink=sink)
            result, ran = run_point(run.point, tune_dir, spec.target, point_runner)
            results.append(result)
            display.point_done(n, "tune " + progress_line(n, len(runs), result), ran)
            write_tune_results(spec, runs, results, [], out)  # partial, if stopped
    finally:
        display.close()
    choices = choose(spec.tune, runs, {r.point.slug: r.metrics[spec.tune.metric] for r in results})
    write_tune_results(spec, runs, results, choices, out)
    return choices


def run_sweep(spec: ExperimentSpec, out: Path, runner: Runner | None = None,
              stream: IO[str] = sys.stdout) -> SweepResult:
    """Run (or resume) every point, write results.csv and results.md, evaluate the checks. Without a
    `runner`, each point is a local cluster whose progress is shown with the sweep's. A spec with a `tune`
    section runs its tuning runs first (run_tuning), then every point at its chosen value."""
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    choices = run_tuning(spec, out, runner, stream)
    points, tuned = spec.tuned_points(choices)
    results = []
    to_run = sum(not finished(out / p.slug) for p in points)
    display = SweepProgress(to_run, len(points), stream)
    recorded = {slug: r.metrics.get("run_s", math.nan) for slug, r in read_results(out).items()}
    try:
        for n, point in enumerate(points, 1):
            sink = display.point(n, point.label)
            point_runner = runner or functools.partial(run_local_quietly, sink=sink)
            result, ran = run_point(point, out, spec.target, point_runner, recorded.get(point.slug, math.nan))
            results.append(result)
            display.point_done(n, progress_line(n, len(points), result), ran)
            partial = SweepResult(spec, results, [], time.monotonic() - started, choices, tuned)
            write_results(partial, out)  # partial, if stopped
    finally:
        display.close()
    outcomes = evaluate_checks(spec.checks, [r.row() for r in results if r.status != "failed"])
    sweep = SweepResult(spec, results, outcomes, time.monotonic() - started, choices, tuned)
    write_results(sweep, out)
    return sweep
