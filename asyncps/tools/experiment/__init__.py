"""`asyncps experiment`: sweeps of local clusters over a grid of run settings, with an automatic check.

A spec is a YAML or TOML file:

```yaml
name: e3_straggler                     # optional; default: the file's stem
description: one 4x straggler ...      # optional; copied into results.md
base: {model: logreg, num_workers: 4, compute_delay: "const:0.05", max_training_s: 5}
grid:                                  # the Cartesian product of every axis, first axis slowest
  seed: [0, 1]                         # an axis named after a RunConfig field: scalar values
  variant:                             # any other name: mappings of several fields (+ a label)
    - {label: sync, mode: sync}
    - {label: sync+1 backup, mode: sync, backup_workers: 1}
target: {metric: accuracy, value: 0.9} # optional: time and updates until the eval reaches it
                                       # (base: {stop_at: "accuracy>=0.9"} ends each run there)
reduced: {grid: {seed: [0]}}           # optional: the smaller version CI runs (--reduced)
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
- `bound`: every selected row has metric `op` (`<`, `<=`, `>`, `>=`) `expected`, an expression over
  the row (e.g. `clock_lead <= staleness_bound`); a missing value fails;
- `compare`: an aggregate (`left_agg`, default mean) of the `left` rows `op` (`<`, `<=`, `>`, `>=`)
  `factor` times an aggregate (`right_agg`) of the `right` rows.
Any claim may say `full_only: <reason>`: the reduced run (`--reduced`, CI) leaves it out, for a claim
too noisy for the reduced run's few seeds; the full sweep checks it.

Modules, one job each: `spec` (the file), `grid` (its points), `metrics` (one run's numbers, read
through `asyncps.rundir`), `expr` (the `expected` expressions), `checks` (the claims), `sweep`
(running the points), `tables` (results.csv and results.md), `command` (the CLI).
"""

from __future__ import annotations

from asyncps.tools.experiment.checks import (
    Approx,
    Bound,
    Check,
    CheckOutcome,
    Compare,
    Row,
    Trend,
    evaluate_checks,
    parse_check,
)
from asyncps.tools.experiment.command import add_arguments, cmd_experiment
from asyncps.tools.experiment.errors import ExperimentError
from asyncps.tools.experiment.expr import evaluate_expression
from asyncps.tools.experiment.grid import RUN_FIELDS, Point, expand_grid, make_run_config
from asyncps.tools.experiment.metrics import METRICS, Target, run_metrics, steady_staleness, time_to_target
from asyncps.tools.experiment.results import PointResult, SweepResult
from asyncps.tools.experiment.spec import SPEC_KEYS, ExperimentSpec, load_spec, parse_spec
from asyncps.tools.experiment.sweep import (
    Runner,
    SweepInterrupted,
    finished,
    run_local_quietly,
    run_point,
    run_sweep,
)
from asyncps.tools.experiment.tables import (
    RESULTS_CSV,
    RESULTS_MD,
    ResultRecord,
    markdown_table,
    read_results,
    results_columns,
    results_markdown,
    write_results,
)

__all__ = [
    "METRICS", "RESULTS_CSV", "RESULTS_MD", "RUN_FIELDS", "SPEC_KEYS", "Approx", "Bound", "Check", "CheckOutcome",
    "Compare",
    "ExperimentError", "ExperimentSpec", "Point", "PointResult", "ResultRecord", "Row", "Runner", "SweepInterrupted",
    "SweepResult", "Target", "Trend", "add_arguments", "cmd_experiment", "evaluate_checks", "evaluate_expression",
    "expand_grid", "finished", "load_spec", "make_run_config", "markdown_table", "parse_check", "parse_spec",
    "read_results", "results_columns", "results_markdown", "run_local_quietly", "run_metrics", "run_point",
    "run_sweep", "steady_staleness", "time_to_target", "write_results",
]
