"""Experiment sweeps and reports: spec parsing, grid expansion, resume, checks, figures; one real sweep."""

from __future__ import annotations

import csv
import dataclasses
import io
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from asyncps.config import RunConfig
from asyncps.rundir import (
    EVAL_CSV,
    PUSHES_CSV,
    SUMMARY_JSON,
    TIMELINE_CSV,
    EvalRow,
    FinalEval,
    PushRow,
    RunConfigRecord,
    RunSummary,
    StalenessSummary,
    StepRow,
    read_rows,
    write_rows,
)
from asyncps.tools.experiment import (
    METRICS,
    ExperimentError,
    Row,
    evaluate_checks,
    evaluate_expression,
    load_spec,
    parse_check,
    parse_spec,
    run_metrics,
    run_sweep,
    steady_staleness,
    time_to_target,
)
from asyncps.tools.report import (
    _series,
    delayed_gd,
    discover_runs,
    group_by_label_without_seed,
    log_x_axis,
    log_y_axis,
    make_report,
    mean_sd,
    plot_scaling,
    plot_staleness,
    pooled_histogram,
    scaling_axis,
    scaling_panels,
    stale_gradient_figure,
    timeline_runs,
    timeline_window,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REPO = Path(__file__).resolve().parent.parent

SPEC_YAML = """
name: demo
description: a demo sweep
base: {model: logreg, num_ps: 1, max_updates: 50, learning_rate: 1}
grid:
  num_workers: [1, 2]
  variant:
    - {label: plain}
    - {label: scaled, staleness_policy: lr-scale}
target: {metric: accuracy, value: 0.5}
check:
  - {kind: trend, metric: staleness_mean, by: num_workers, direction: increasing, why: more workers}
"""


def write_spec(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- spec parsing and grid expansion --------------------------------------------------------------
def test_yaml_spec_expands_the_grid_first_axis_slowest(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, SPEC_YAML))
    points = spec.points()
    assert [p.label for p in points] == ["num_workers=1, plain", "num_workers=1, scaled",
                                         "num_workers=2, plain", "num_workers=2, scaled"]
    assert [p.slug for p in points][:2] == ["00-num_workers=1_plain", "01-num_workers=1_scaled"]
    assert points[3].config.num_workers == 2 and points[3].config.staleness_policy == "lr-scale"
    assert points[0].config.staleness_policy == "none"
    # a max_updates stop without epochs means epochs 0, as on the command line; ints become floats
    assert points[0].config.epochs == 0.0
    assert isinstance(points[0].config.learning_rate, float)
    assert points[1].axes == {"num_workers": 1, "variant": "scaled"}
    assert spec.target is not None and spec.target.describe() == "accuracy >= 0.5"


def test_toml_spec_reads_like_yaml(tmp_path: Path) -> None:
    text = """
name = "t"
[base]
model = "logreg"
max_training_s = 2
[grid]
mode = ["async", "sync"]
[[check]]
kind = "compare"
metric = "updates_per_s"
left = {mode = "async"}
right = {mode = "sync"}
op = ">="
"""
    spec = load_spec(write_spec(tmp_path, text, "spec.toml"))
    assert [p.config.mode for p in spec.points()] == ["async", "sync"]
    assert spec.checks[0].kind == "compare"


@pytest.mark.parametrize(("text", "message"), [
    ("base: {modle: mlp}\n", "unknown RunConfig fields"),
    ("base: {max_updates: 5}\ngrid: {flavour: [1, 2]}\n", "not a RunConfig field"),
    ("base: {max_updates: 5}\ngrid: {num_workers: []}\n", "non-empty list"),
    ("base: {max_updates: 5, num_workers: 2}\ngrid: {backup_workers: [0, 2]}\n", "point 1"),
    ("base: {max_updates: 5}\nrepeat: 3\n", "unknown spec keys"),
    ("base: {max_updates: 5}\ntarget: {metric: f1, value: 1}\n", "target metric"),
    ("base: {max_updates: 5}\ncheck: [{kind: approx, metric: nope}]\n", "unknown metric"),
    ("base: {max_updates: 5}\ncheck: [{kind: vibes, metric: wall_s}]\n", "unknown kind"),
    ("base: {max_updates: 5}\ncheck: [{kind: approx, metric: wall_s, where: {colour: red}}]\n", "filters"),
    ("base: {max_updates: 5}\ncheck: [{kind: approx, metric: wall_s, tolerance: 1}]\n", "unknown keys"),
    ("base: {max_updates: 5}\ncheck: [{kind: trend, metric: wall_s, direction: sideways}]\n", "direction"),
])
def test_bad_specs_are_rejected_before_anything_runs(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ExperimentError, match=message):
        load_spec(write_spec(tmp_path, text))


def test_a_spec_without_a_grid_is_one_point() -> None:
    spec = parse_spec({"base": {"max_training_s": 1}})
    assert [p.label for p in spec.points()] == ["base"]


# -- checks ---------------------------------------------------------------------------------------
def row(label: str, **values: Any) -> Row:
    metrics = {k: float(v) for k, v in values.items() if k in METRICS}
    settings = {k: v for k, v in values.items() if k not in METRICS}
    return Row(label, {**dataclasses.asdict(RunConfig(max_training_s=1)), **settings, "label": label},
               {**dict.fromkeys(METRICS, math.nan), **metrics})


NAMES = {f.name for f in dataclasses.fields(RunConfig)} | {"label", "variant"}


def verdicts(check: dict[str, Any], rows: list[Row]) -> tuple[bool, str]:
    outcome = evaluate_checks([parse_check(check, NAMES)], rows)[0]
    return outcome.passed, outcome.detail


def test_approx_check_uses_an_expression_of_the_row() -> None:
    rows = [row(f"w{n}", num_workers=n, staleness_mean=n - 1 + 0.2) for n in (1, 2, 4, 8)]
    check = {"kind": "approx", "metric": "staleness_mean", "expected": "num_workers - 1", "abs_tol": 0.25}
    assert verdicts(check, rows)[0]
    passed, detail = verdicts({**check, "abs_tol": 0.1}, rows)
    assert not passed and "✗" in detail
    assert verdicts({**check, "abs_tol": 0.0, "rel_tol": 0.1, "where": {"num_workers": [4, 8]}}, rows)[0]
    assert not verdicts({**check, "where": {"num_workers": 16}}, rows)[0]  # no rows: FAIL, not vacuous PASS


def test_trend_check_averages_groups_and_honours_slack_and_ratio() -> None:
    rows = [row("a", num_workers=1, optimality_gap=0.10), row("b", num_workers=1, optimality_gap=0.12),
            row("c", num_workers=4, optimality_gap=0.10), row("d", num_workers=8, optimality_gap=0.40)]
    base = {"kind": "trend", "metric": "optimality_gap", "by": "num_workers", "direction": "increasing"}
    passed, detail = verdicts(base, rows)
    assert not passed and "1→4" in detail  # mean 0.11 at λ=1, then 0.10
    assert verdicts({**base, "rel_slack": 0.1}, rows)[0]
    assert verdicts({**base, "rel_slack": 0.1, "min_ratio": 3}, rows)[0]
    assert not verdicts({**base, "rel_slack": 0.1, "min_ratio": 4}, rows)[0]
    assert not verdicts({**base, "direction": "decreasing"}, rows)[0]
    idle = [row(f"s{s}", staleness_bound=s, idle_pct=v) for s, v in ((0, 50), (2, 20), (8, 20.5))]
    down = {"kind": "trend", "metric": "idle_pct", "by": "staleness_bound", "direction": "nonincreasing"}
    assert not verdicts(down, idle)[0]
    assert verdicts({**down, "abs_slack": 1, "min_ratio": 2}, idle)[0]


def test_trend_check_fails_on_missing_values() -> None:
    rows = [row("a", staleness_bound=0, updates_to_target=100), row("b", staleness_bound=4)]
    passed, detail = verdicts({"kind": "trend", "metric": "updates_to_target", "by": "staleness_bound",
                               "direction": "nondecreasing"}, rows)
    assert not passed and "missing" in detail


def test_compare_check_with_aggregates_and_factor() -> None:
    rows = [row("sync", variant="sync", updates_per_s=5), row("backup", variant="backup", updates_per_s=16),
            row("async", variant="async", updates_per_s=50)]
    check = {"kind": "compare", "metric": "updates_per_s", "left": {"variant": "backup"},
             "right": {"variant": "sync"}, "op": ">=", "factor": 3}
    passed, detail = verdicts(check, rows)
    assert passed and "ratio 3.2" in detail
    assert not verdicts({**check, "factor": 4}, rows)[0]
    assert verdicts({**check, "left": {"variant": ["backup", "async"]}, "left_agg": "min"}, rows)[0]
    assert not verdicts({**check, "right": {"variant": "nope"}}, rows)[0]


def test_expressions_allow_arithmetic_only() -> None:
    names = {"num_workers": 8, "x": 2}.__getitem__
    assert evaluate_expression("num_workers - 1", names) == 7
    assert evaluate_expression("max(1, x ** 2) / 2", names) == 2
    for bad in ("__import__('os')", "x.real", "[x]", "lambda: 1"):
        with pytest.raises(ExperimentError):
            evaluate_expression(bad, names)


# -- metrics of a run directory ---------------------------------------------------------------------
def fake_run(run_dir: Path, config: RunConfig, *, rate: float, staleness: int = 0, accuracy_end: float = 0.9,
             gap: float | None = None, stop_reason: str = "reached 50 updates", dropped_every: int = 0) -> None:
    """A run directory with the files the chief writes, from a made-up steady run of 2 s."""
    run_dir.mkdir(parents=True, exist_ok=True)
    RunConfigRecord.of(config, [], run_dir).save(run_dir)
    workers, wall = config.num_workers, 2.0
    pushes: list[PushRow] = []
    steps: list[StepRow] = []
    step_s = workers / rate
    for w in range(workers):
        t, n = 100.0 + 0.01 * w, 0
        while t < 100.0 + wall:
            n += 1
            accepted = not (dropped_every and n % dropped_every == 0)
            pushes.append(PushRow(t + step_s, w, 0, n, 0, staleness, staleness, accepted, "", 0.1, 0.5))
            steps.append(StepRow(w, n, t, 0.01 if n == 1 else 0.0, step_s * 0.7, step_s * 0.1, step_s * 0.2, 32))
            t += step_s
    write_rows(run_dir / PUSHES_CSV, pushes, PushRow)
    write_rows(run_dir / TIMELINE_CSV, steps, StepRow)
    evals = [EvalRow(100 + i * 0.5, i * 0.5, int(i * 0.5 * rate), (0,), 1.0 - 0.1 * i, accuracy_end * i / 4)
             for i in range(5)]
    write_rows(run_dir / EVAL_CSV, evals, EvalRow)
    RunSummary(
        updates_applied=int(rate * wall), updates_dropped=0, wall_s=wall, mode=config.mode,
        staleness_policy=config.staleness_policy, throughput_updates_per_s=rate, workers=workers, ps_shards=1,
        model=config.model, dataset=config.dataset, epochs=1.0, stop_reason=stop_reason,
        pushes_recorded=len(pushes), dropped_by_reason={}, backup_workers=config.backup_workers,
        staleness_bound=config.staleness_bound, shards=(),
        staleness=StalenessSummary(float(staleness), staleness, staleness, staleness, len(pushes),
                                   {staleness: len(pushes)}),
        final_eval=FinalEval(loss=0.6, accuracy=accuracy_end),
        idle_fraction=dict.fromkeys(range(workers), 0.2), optimality_gap=gap,
    ).save(run_dir)


def test_run_metrics_from_a_run_directory(tmp_path: Path) -> None:
    fake_run(tmp_path / "r", RunConfig(num_workers=2, max_training_s=2), rate=20, staleness=1, dropped_every=4)
    from asyncps.tools.experiment import Target

    m = run_metrics(tmp_path / "r", Target("accuracy", 0.4))
    assert m["updates_per_s"] == 20 and m["staleness_mean"] == 1 and m["idle_pct"] == pytest.approx(20)
    assert m["dropped_pct"] == pytest.approx(25, abs=3)
    # accuracy 0.225 at the second eval (0.5 s, 10 updates), 0.45 at the third (1 s, 20): interpolated
    assert m["time_to_target_s"] == pytest.approx(0.5 + 0.5 * 0.175 / 0.225)
    assert m["updates_to_target"] == pytest.approx(10 + 10 * 0.175 / 0.225)
    assert math.isnan(m["optimality_gap"])
    assert set(m) == set(METRICS) - {"run_s"}
    pushes = len(read_rows(tmp_path / "r" / PUSHES_CSV, PushRow))  # one shard, 40 updates
    assert m["pushes_to_target"] == pytest.approx(m["updates_to_target"] * pushes / 40)


def test_pushes_to_target_counts_a_sync_update_as_its_pushes() -> None:
    from asyncps.tools.experiment.metrics import pushes_to_target

    # sync over 4 workers and 2 shards: 50 updates, 400 push rows (4 per update on each shard)
    assert pushes_to_target(10.0, 400, 2, 50) == pytest.approx(40.0)
    assert pushes_to_target(10.0, 100, 2, 50) == pytest.approx(10.0)  # async: one push per update
    assert math.isnan(pushes_to_target(math.nan, 400, 2, 50))  # never reached
    assert math.isnan(pushes_to_target(10.0, 0, 1, 0))


def test_time_to_target_and_steady_staleness() -> None:
    from asyncps.tools.experiment import Target

    evals = [EvalRow(0.0, 1.0, 10, (10,), 0.9, 0.5), EvalRow(0.0, 2.0, 25, (25,), 0.4, 0.8)]
    assert time_to_target(evals, Target("loss", 0.5)) == pytest.approx((1.8, 22.0))  # interpolated
    assert time_to_target(evals, Target("accuracy", 0.5)) == (1.0, 10.0)  # met at the first evaluation
    assert all(math.isnan(x) for x in time_to_target(evals, Target("accuracy", 0.95)))
    pushes = [PushRow(wall, worker, 0, 0, 0, 0, staleness, True, "", 0.1, 0.5)
              for wall, worker, staleness in ((1, 0, 0), (3, 1, 40), (4, 0, 1), (5, 1, 1))]
    assert steady_staleness(pushes) == 1.0  # worker 1's first push (tracing) and everything before it left out


# -- sweeps with a fake runner: results files, resume, interruption, checks -------------------------
class FakeRunner:
    """Writes a made-up run directory instead of starting a cluster; counts the runs."""

    def __init__(self, fail: str = "", interrupt: str = "") -> None:
        self.calls: list[str] = []
        self.fail, self.interrupt = fail, interrupt

    def __call__(self, run: RunConfig, run_dir: Path) -> int:
        self.calls.append(run_dir.name)
        if self.fail and self.fail in run_dir.name:
            run_dir.mkdir(parents=True)
            return 1
        stop = "interrupted" if self.interrupt and self.interrupt in run_dir.name else "reached"
        fake_run(run_dir, run, rate=10.0 * run.num_workers, staleness=run.num_workers - 1, stop_reason=stop)
        return 0


def test_sweep_writes_results_and_resumes_without_rerunning(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, SPEC_YAML))
    out, runner, stream = tmp_path / "out", FakeRunner(), io.StringIO()
    sweep = run_sweep(spec, out, runner, stream)
    assert len(runner.calls) == 4 and sweep.passed
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["point", "label", "num_workers", "variant", "status", *METRICS]
    assert [r["label"] for r in rows] == [p.label for p in spec.points()]
    assert rows[2]["staleness_mean"] == "1" and rows[2]["variant"] == "plain" and rows[2]["status"] == "ran"
    md = (out / "results.md").read_text()
    assert "| run | updates/s" in md and "## Check: PASS" in md and "num_workers=2, scaled" in md
    assert len(stream.getvalue().splitlines()) == 4  # one line per point

    again = FakeRunner()
    sweep = run_sweep(spec, out, again, io.StringIO())
    assert again.calls == [] and {r.status for r in sweep.results} == {"resumed"} and sweep.passed

    # an unfinished point (no summary) is started over; a finished one of another config is an error
    (out / "01-num_workers=1_scaled" / SUMMARY_JSON).unlink()
    run_sweep(spec, out, again, io.StringIO())
    assert again.calls == ["01-num_workers=1_scaled"]
    changed = parse_spec({**_spec_dict(), "base": {**_spec_dict()["base"], "learning_rate": 0.5}})
    with pytest.raises(ExperimentError, match="another configuration"):
        run_sweep(changed, out, FakeRunner(), io.StringIO())


def _spec_dict() -> dict[str, Any]:
    import yaml

    data: dict[str, Any] = yaml.safe_load(SPEC_YAML)
    return data


def test_failed_points_and_failed_checks_fail_the_sweep(tmp_path: Path) -> None:
    spec = parse_spec({**_spec_dict(), "check": [{"kind": "compare", "metric": "updates_per_s",
                                                  "left": {"num_workers": 1}, "right": {"num_workers": 2},
                                                  "op": ">", "why": "wrong on purpose"}]})
    sweep = run_sweep(spec, tmp_path / "out", FakeRunner(fail="02-"), io.StringIO())
    assert not sweep.passed
    assert [r.status for r in sweep.results] == ["ran", "ran", "failed", "ran"]
    assert not sweep.outcomes[0].passed and "FAIL" in sweep.outcomes[0].describe()
    assert "(failed)" in (tmp_path / "out" / "results.md").read_text()


def test_an_interrupted_point_stops_the_sweep_and_is_rerun_next_time(tmp_path: Path) -> None:
    from asyncps.tools.experiment import SweepInterrupted

    spec = load_spec(write_spec(tmp_path, SPEC_YAML))
    with pytest.raises(SweepInterrupted):
        run_sweep(spec, tmp_path / "out", FakeRunner(interrupt="01-"), io.StringIO())
    runner = FakeRunner()
    run_sweep(spec, tmp_path / "out", runner, io.StringIO())
    assert runner.calls == ["01-num_workers=1_scaled", "02-num_workers=2_plain", "03-num_workers=2_scaled"]


def test_older_and_unreadable_summaries_in_a_sweep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from asyncps.rundir import RunDirError
    from asyncps.tools.report import main as report_main

    spec = load_spec(write_spec(tmp_path, SPEC_YAML))
    out = tmp_path / "out"
    run_sweep(spec, out, FakeRunner(), io.StringIO())
    path = out / "00-num_workers=1_plain" / SUMMARY_JSON
    data = json.loads(path.read_text())
    for later in ("data", "idle_fraction", "max_clock_lead"):  # a run directory of an earlier chief
        data.pop(later, None)
    path.write_text(json.dumps(data))
    m = run_metrics(path.parent)
    assert math.isnan(m["idle_pct"]) and m["updates_per_s"] == 10
    del data["wall_s"]  # not a summary any chief wrote: a clear error, and the point is not re-run
    path.write_text(json.dumps(data))
    runner = FakeRunner()
    with pytest.raises(RunDirError, match=r"00-num_workers=1_plain/summary.json: missing field 'wall_s'"):
        run_sweep(spec, out, runner, io.StringIO())
    assert runner.calls == [] and path.exists()
    assert report_main([str(out)]) == 2
    assert "missing field 'wall_s'" in capsys.readouterr().err


def test_the_shipped_experiment_specs_parse() -> None:
    specs = sorted((REPO / "experiments").glob("e*.yaml"))
    assert len(specs) >= 5
    for path in specs:
        spec = load_spec(path)
        assert spec.checks, f"{path.name} has no check"
        assert len(spec.points()) >= 2, path.name
        # what CI runs: a few minutes a spec (E5 needs six runs a side: its final gap is one noisy sample); the
        # tuned specs' reduced runs are not run in CI (tests/test_experiments_ci.py says why): E7's has all four
        # optimizers at λ = 1 and 8, 48 points, so that its optimizer checks run
        most = 48 if path.stem.endswith("_tuned") else 12
        assert 2 <= len(load_spec(path, reduced=True).points()) <= most, path.name


# -- reports -----------------------------------------------------------------------------------------
def assert_png(path: Path, min_bytes: int = 5_000) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert min_bytes < len(data) < 400_000, (path, len(data))


def test_report_of_a_sweep_and_of_one_run(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, SPEC_YAML))
    run_sweep(spec, tmp_path / "out", FakeRunner(), io.StringIO())
    runs = discover_runs(tmp_path / "out")
    assert [r.label for r in runs] == [p.label for p in spec.points()]  # labels from results.csv
    report = make_report(tmp_path / "out")
    for name in ("curves", "staleness", "timeline", "scaling"):
        assert_png(tmp_path / "out" / "figures" / f"{name}.png")
        assert f"(figures/{name}.png)" in report.read_text()
    single = make_report(tmp_path / "out" / "00-num_workers=1_plain", tmp_path / "figs", prefix="one_")
    assert_png(tmp_path / "figs" / "one_timeline.png")
    assert "../../figs/one_curves.png" in single.read_text()
    with pytest.raises(ExperimentError):
        discover_runs(tmp_path / "figs")


SEEDED_SPEC_YAML = """
name: seeded
base: {model: logreg, num_ps: 1, max_updates: 50, learning_rate: 1}
grid:
  variant:
    - {label: plain}
    - {label: lr-scale, staleness_policy: lr-scale}
  workers:
    - {label: "λ=1", num_workers: 1}
    - {label: "λ=4", num_workers: 4}
    - {label: "λ=16", num_workers: 16}
  seed: [0, 1, 2]
"""


class SeededRunner:
    """Made-up runs whose throughput differs by seed (the spread the figure must show)."""

    def __call__(self, run: RunConfig, run_dir: Path) -> int:
        scale = 2.0 if run.staleness_policy == "lr-scale" else 1.0
        fake_run(run_dir, run, rate=scale * 10.0 * run.num_workers * (1 + 0.1 * (run.seed - 1)),
                 staleness=run.num_workers - 1, accuracy_end=0.8 + 0.05 * run.seed)
        return 0


def test_the_scaling_figure_shows_mean_and_sd_per_spec_label(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, SEEDED_SPEC_YAML))
    run_sweep(spec, tmp_path / "out", SeededRunner(), io.StringIO())
    runs = discover_runs(tmp_path / "out")
    # one series per variant label: the λ part names the x value, the seed is what the spread is over
    assert list(dict.fromkeys(_series(runs, "num_workers"))) == ["async plain", "async lr-scale"]
    rates = [r.metrics["updates_per_s"] for r in runs if r.label.startswith("plain, λ=4,")]
    mean, sd = mean_sd(rates)
    assert len(rates) == 3 and mean == pytest.approx(40) and sd == pytest.approx(4)
    assert_png(plot_scaling(runs, tmp_path / "scaling.png") or tmp_path / "none")
    assert mean_sd([1.0, math.nan]) == (1.0, 0.0) and all(math.isnan(v) for v in mean_sd([math.nan]))
    # no empty panel: staleness measured (λ > 1) is drawn; a metric that is zero in every run is not
    metrics = [m for m, _ in scaling_panels(runs)]
    assert "staleness_mean" in metrics and "updates_per_s" in metrics
    for run in runs:  # the metrics of sync runs (a cached property: set on the instance)
        run.__dict__["metrics"] = {**run.metrics, "staleness_mean": 0.0}
    assert "staleness_mean" not in [m for m, _ in scaling_panels(runs)]


# E1's shape: λ in variants whose step time and length scale with λ, 1 and 2 shards, three seeds
WORKERS_SPEC_YAML = """
name: workers
base: {model: logreg, max_updates: 50, learning_rate: 1}
grid:
  seed: [0, 1, 2]
  num_ps: [1, 2]
  variant:
    - {label: "λ=1", num_workers: 1, compute_delay: "const:0.01", max_updates: 60}
    - {label: "λ=4", num_workers: 4, worker_processes: 2, compute_delay: "const:0.02", max_updates: 480}
    - {label: "λ=16", num_workers: 16, worker_processes: 2, compute_delay: "const:0.04", max_updates: 192}
    - {label: "λ=16 lr-scale", num_workers: 16, worker_processes: 2, compute_delay: "const:0.04", max_updates: 192,
       staleness_policy: lr-scale}
    - {label: "λ=64 lr-scale", num_workers: 64, worker_processes: 2, staleness_policy: lr-scale}
"""


def test_the_scaling_figure_of_a_worker_sweep_reads_well(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, WORKERS_SPEC_YAML))
    run_sweep(spec, tmp_path / "out", SeededRunner(), io.StringIO())
    runs = discover_runs(tmp_path / "out")
    # λ on a log axis; the legend names a handful of readable series, not raw setting strings: the λ word
    # and the settings that follow from λ (step time, length, processes) name the x value, not a series
    assert scaling_axis(runs) == "num_workers" and log_x_axis("num_workers", [1, 4, 16, 64, 256])
    assert not log_x_axis("staleness_bound", [0, 1, 2, 4, 8]) and not log_x_axis("num_workers", [4])
    # a gap of 0.003 at λ = 4 and 2.3 at λ = 256: log; a staleness of 0 at λ = 1, or a narrow range: linear
    assert log_y_axis([0.003, 0.005, 0.16, 2.3, math.nan]) and not log_y_axis([0.0, 3.0, 255.0])
    assert not log_y_axis([8.6, 36.0, 64.0]) and not log_y_axis([math.nan])
    assert list(dict.fromkeys(_series(runs, "num_workers"))) == [
        "async, 1 shard", "async lr-scale, 1 shard", "async, 2 shards", "async lr-scale, 2 shards"]
    for run in runs:  # without the spec's labels: named by the settings that do not follow from λ
        run.label = ""
    assert set(_series(runs, "num_workers")) == {
        "async, 1 shard", "async lr-scale, 1 shard", "async, 2 shards", "async lr-scale, 2 shards"}
    # async runs are never held back: no idle panel (a fake run has idle 20%: made 0 as a real async run's)
    assert "idle_pct" in [m for m, _ in scaling_panels(runs)]
    for run in runs:
        run.__dict__["metrics"] = {**run.metrics, "idle_pct": 0.0}
    assert "idle_pct" not in [m for m, _ in scaling_panels(runs)]
    assert_png(plot_scaling(runs, tmp_path / "scaling.png") or tmp_path / "none")


def test_ssp_bounds_go_on_the_x_axis_and_settings_are_named_readably(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, """
name: bounds
base: {model: logreg, max_updates: 50, num_workers: 4, mode: ssp}
grid:
  seed: [0, 1]
  num_ps: [1, 2]
  staleness_bound: [0, 2, 8]
"""))
    run_sweep(spec, tmp_path / "out", SeededRunner(), io.StringIO())
    runs = discover_runs(tmp_path / "out")  # the mode spec (ssp:bound=S) follows the bound: not a second axis
    assert scaling_axis(runs) == "staleness_bound"
    assert list(dict.fromkeys(_series(runs, "staleness_bound"))) == ["ssp, 1 shard", "ssp, 2 shards"]
    # settings without a numeric axis: one bar per setting, named without raw setting strings
    spec = load_spec(write_spec(tmp_path, """
name: policies
base: {model: logreg, max_updates: 50, num_workers: 4}
grid:
  seed: [0, 1]
  num_ps: [1, 2]
  staleness_policy: [none, dc-asgd, "dc-asgd-a:lambda0=1"]
""", "policies.yaml"))
    run_sweep(spec, tmp_path / "policies", SeededRunner(), io.StringIO())
    runs = discover_runs(tmp_path / "policies")
    assert scaling_axis(runs) is None
    groups = group_by_label_without_seed(runs)
    assert [name for name, _ in groups] == ["async, 1 shard", "async dc-asgd, 1 shard",
                                            "async dc-asgd-a:lambda0=1, 1 shard", "async, 2 shards",
                                            "async dc-asgd, 2 shards", "async dc-asgd-a:lambda0=1, 2 shards"]
    assert all(len(members) == 2 for _, members in groups)
    assert_png(plot_scaling(runs, tmp_path / "bars.png") or tmp_path / "none")
    # a diverged run (E5's dc-asgd-a: a gap of 1e12 beside 0.1) puts that panel's bars on a log axis
    runs[2].__dict__["metrics"] = {**runs[2].metrics, "updates_per_s": 1e12}
    assert log_y_axis([r.metrics["updates_per_s"] for r in runs])
    assert_png(plot_scaling(runs, tmp_path / "diverged.png") or tmp_path / "none")


def test_staleness_histograms_pool_seeds_and_the_timeline_picks_one_run_per_setting(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, WORKERS_SPEC_YAML))
    run_sweep(spec, tmp_path / "out", SeededRunner(), io.StringIO())
    runs = discover_runs(tmp_path / "out")
    groups = group_by_label_without_seed(runs)  # 10 settings of 3 seeds: 10 panels (titled λ=4, 1 shard), not 30
    assert len(groups) == 10 and groups[1][0] == "async, λ=4, 1 shard"
    pooled = pooled_histogram(groups[1][1])
    assert pooled == [(3, sum(r.summary.staleness.count for r in groups[1][1]))]
    assert_png(plot_staleness(runs, tmp_path / "staleness.png") or tmp_path / "none")
    # 10 settings do not fit in 4 panels: the first seed of each setting of the first shard count
    picked = timeline_runs(runs, 4)
    assert [name for name, _ in picked] == ["async, λ=1, 1 shard", "async, λ=4, 1 shard", "async, λ=16, 1 shard",
                                            "async, λ=16 lr-scale, 1 shard"]
    assert all(run.config["seed"] == 0 for _, run in picked)


def test_timeline_window_skips_start_up() -> None:
    steps = [StepRow(0, 1, 0.0, 0.1, 2.0, 0.01, 0.0, 32), StepRow(1, 1, 0.5, 0.1, 0.05, 0.01, 0.0, 32),
             *[StepRow(w, n, 2.0 + n * 0.1, 0.0, 0.08, 0.01, 0.01, 32) for w in (0, 1) for n in range(2, 60)]]
    lo, hi = timeline_window(steps, 2.0)
    assert lo >= 2.01 and hi - lo == 2.0


def test_stale_gradient_figure_and_its_simulation(tmp_path: Path) -> None:
    assert delayed_gd(0.5, 0, 3) == [2.0, 1.0, 0.5, 0.25]
    assert delayed_gd(0.7, 1, 2)[-1] == pytest.approx(2.0 - 1.4 - 1.4)  # the stale step overshoots
    assert_png(stale_gradient_figure(tmp_path / "stale.png"))
    result = subprocess.run([sys.executable, "-m", "asyncps.tools.report", "--stale-gradient-figure",
                             str(tmp_path / "cli.png")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert_png(tmp_path / "cli.png")


# -- the real thing -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_tiny_sweep_end_to_end(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, """
name: tiny
base: {model: logreg, num_ps: 1, max_updates: 30, eval_every_s: 0.5, compute_delay: "const:0.01"}
grid:
  num_workers: [1, 2]
target: {metric: accuracy, value: 0.2}
check:
  - kind: approx
    metric: staleness_mean
    expected: "0"
    where: {num_workers: 1}
    why: one worker's gradients are never stale
""")
    out = tmp_path / "sweep"
    cli = [sys.executable, "-m", "asyncps.tools.cli"]
    result = subprocess.run([*cli, "experiment", str(spec), "--out", str(out)], capture_output=True, text=True,
                            timeout=280, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[1/2] num_workers=1" in result.stdout and "check: PASS" in result.stdout
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["label"] for r in rows] == ["num_workers=1", "num_workers=2"]
    assert list(rows[0]) == ["point", "label", "num_workers", "status", *METRICS]
    assert all(r["status"] == "ran" and float(r["updates"]) >= 30 and float(r["updates_per_s"]) > 0 for r in rows)
    assert (out / "results.md").read_text().count("\n| num_workers=") == 2

    again = subprocess.run([*cli, "experiment", str(spec), "--out", str(out)], capture_output=True, text=True,
                           timeout=120, cwd=REPO)
    assert again.returncode == 0 and again.stdout.count("(resumed)") == 2, again.stdout + again.stderr

    report = subprocess.run([*cli, "report", str(out)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert report.returncode == 0, report.stdout + report.stderr
    for name in ("curves", "staleness", "timeline", "scaling"):
        assert_png(out / "figures" / f"{name}.png")
    assert "![timeline](figures/timeline.png)" in (out / "report.md").read_text()


def test_the_loss_curves_figure_draws_mean_and_sd_per_variant(tmp_path: Path) -> None:
    from asyncps.tools.experiment.momentum_figure import loss_curves_figure, mean_sd_curve

    # seeds evaluated at different update counts: the mean is taken where all of them have a value
    xs, means, sds = mean_sd_curve([([0, 10, 20], [1.0, 0.5, 0.3]), ([0, 5, 15], [1.2, 0.9, 0.5])])
    assert xs == [0, 5, 10, 15]
    assert means[0] == pytest.approx(1.1) and sds[0] == pytest.approx(math.sqrt(0.02))
    assert means[1] == pytest.approx((0.75 + 0.9) / 2) and means[3] == pytest.approx((0.4 + 0.5) / 2)
    spec_path = write_spec(tmp_path, """
name: curves
base: {model: logreg, num_ps: 1, max_updates: 50, num_workers: 4}
grid:
  variant:
    - {label: "lr 1"}
    - {label: "lr 0.5", learning_rate: 0.5}
  seed: [0, 1, 2]
target: {metric: loss, value: 0.5}
""")
    spec = load_spec(spec_path)
    for point in spec.points():
        run_dir = tmp_path / "out" / point.slug
        fake_run(run_dir, point.config, rate=20)
        write_rows(run_dir / EVAL_CSV, [EvalRow(100 + i, float(i), 10 * i + point.config.seed, (0,),
                                                1.0 / (1 + i) + 0.05 * point.config.seed, 0.5) for i in range(6)],
                   EvalRow)
    assert loss_curves_figure(spec_path, tmp_path / "out", tmp_path / "curves.png") == 6
    assert_png(tmp_path / "curves.png")
    # E10's form: accuracy against pushes per shard
    assert loss_curves_figure(spec_path, tmp_path / "out", tmp_path / "acc.png", x="pushes", y="accuracy") == 6
    assert_png(tmp_path / "acc.png")
    assert loss_curves_figure(spec_path, tmp_path / "out", tmp_path / "clock.png", x="seconds",
                              only=["lr 1"]) == 3  # E8's form: error against wall clock, some variants
    assert_png(tmp_path / "clock.png")
