"""E6's figure: the test loss against updates of a sweep, one colour per variant: the mean over seeds ± sd.
(`--y accuracy` draws the test accuracy, `--x pushes` puts the pushes per shard on the x axis, so that a
sync update of n pushes and an async one of 1 compare by what was sent: E10; `--x seconds` the seconds
of training, error against wall clock: E8.)

Asynchrony begets momentum (Mitliagkas et al. 2016) shows in the shape of these curves rather than
in any one number: the run that keeps the one-worker momentum overshoots (its loss climbs back after
the first updates), the run with the momentum lowered by 1 - 1/λ does not. The dashed line is the
target whose updates-to-reach the checks compare.

    python -m asyncps.tools.experiment.momentum_figure experiments/e6_async_momentum.yaml \\
        runs/e6_async_momentum docs/figures/e6_momentum.png
"""

from __future__ import annotations

import argparse
import bisect
import sys
from collections.abc import Sequence
from pathlib import Path

from asyncps.rundir import EVAL_CSV, EvalRow, PushRow, RunDir, iter_rows, load_summary, read_rows
from asyncps.tools.experiment.errors import ExperimentError
from asyncps.tools.experiment.metrics import excess, optimal_test_loss
from asyncps.tools.experiment.spec import load_spec
from asyncps.tools.report import _color, _pyplot, _save, mean_sd


def _interpolate(xs: Sequence[float], ys: Sequence[float], at: float) -> float:
    """ys at `at`, linear between the neighbouring xs (xs increasing, at within their range)."""
    i = bisect.bisect_left(xs, at)
    if i < len(xs) and xs[i] == at:
        return ys[i]
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (at - x0) / (x1 - x0)


def mean_sd_curve(curves: Sequence[tuple[Sequence[float], Sequence[float]]],
                  ) -> tuple[list[float], list[float], list[float]]:
    """The mean and sd of several (updates, loss) curves (one per seed) at every update count any of them
    was evaluated at, within the range all of them cover (interpolated between evaluations)."""
    lo = max(xs[0] for xs, _ in curves)
    hi = min(xs[-1] for xs, _ in curves)
    grid = sorted({x for xs, _ in curves for x in xs if lo <= x <= hi})
    means, sds = [], []
    for x in grid:
        mean, sd = mean_sd([_interpolate(xs, ys, x) for xs, ys in curves])
        means.append(mean)
        sds.append(sd)
    return grid, means, sds


def pushes_per_update(run_dir: Path) -> float:
    """The run's pushes per shard for each update applied (pushes.csv against summary.json)."""
    summary = load_summary(run_dir)
    pushes = sum(1 for _ in iter_rows(RunDir(run_dir).pushes, PushRow))
    if summary.updates_applied <= 0:
        raise ExperimentError(f"{run_dir}: no update applied")
    return pushes / max(1, summary.ps_shards) / summary.updates_applied


def loss_curves_figure(spec_path: Path, runs: Path, out: Path, reduced: bool = False, x: str = "updates",
                       y: str = "loss", only: Sequence[str] = ()) -> int:
    """Draw the test loss (or accuracy) against updates (or pushes per shard), one colour per variant
    label: the mean over its seeds with a band of ± one sd (a single run as its own line); the number
    of runs drawn."""
    spec = load_spec(spec_path, reduced=reduced)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    curves: dict[str, list[tuple[list[float], list[float]]]] = {}
    excess_target = spec.target is not None and spec.target.metric == "excess_loss"
    for point in spec.points():
        eval_csv = RunDir(runs / point.slug).evals
        if not eval_csv.exists():
            continue
        rows = read_rows(eval_csv, EvalRow)
        if excess_target:  # each seed's own data: curves drawn above that data's optimum
            rows = excess(rows, optimal_test_loss(runs / point.slug))
        if not rows:
            continue
        # one curve per variant, else per setting of the other axes: seeds and shard counts pooled
        variant = str(point.axes["variant"]) if "variant" in point.axes else ", ".join(
            f"{k}={v}" for k, v in point.axes.items() if k not in ("seed", "num_ps")) or point.label
        if only and variant not in only:
            continue
        scale = pushes_per_update(runs / point.slug) if x == "pushes" else 1.0
        xs = [r.elapsed_s for r in rows] if x == "seconds" else [scale * r.updates for r in rows]
        curves.setdefault(variant, []).append((xs, [r.accuracy if y == "accuracy" else r.loss for r in rows]))
    drawn = sum(len(c) for c in curves.values())
    if not drawn:
        raise ExperimentError(f"no {EVAL_CSV} under {runs} for the points of {spec_path}")
    seeds = max(len(c) for c in curves.values())
    same = len({len(c) for c in curves.values()}) == 1  # then the title says it once, not every legend entry
    for i, (variant, members) in enumerate(curves.items()):
        xs, means, sds = mean_sd_curve(members)
        label = variant + (f" (mean ± sd of {len(members)} runs)" if len(members) > 1 and not same else "")
        ax.plot(xs, means, color=_color(i), lw=1.4, label=label)
        if len(members) > 1:
            ax.fill_between(xs, [m - sd for m, sd in zip(means, sds, strict=True)],
                            [m + sd for m, sd in zip(means, sds, strict=True)], color=_color(i), alpha=0.2, lw=0)
    if spec.target is not None and (spec.target.metric == "accuracy") == (y == "accuracy"):
        ax.axhline(spec.target.value, color="black", ls="--", lw=0.8, label=f"target: {spec.target.describe()}")
    ax.set_xlabel({"pushes": "pushes per shard (a sync update is one per worker)",
                   "seconds": "seconds of training (wall clock)"}.get(x, "updates applied"))
    what = "test accuracy" if y == "accuracy" else "test loss"
    ax.set_ylabel(what if y == "accuracy" else "test loss above the optimum's" if excess_target else what)
    per_variant = (f" (mean ± sd of {seeds} runs per variant)" if same else f" (up to {seeds} runs per variant)")
    ax.set_title(f"{spec.name}: {what}, {drawn} runs" + (per_variant if seeds > 1 else ""))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    _save(fig, out)
    return drawn


def main(argv: Sequence[str] | None = None) -> int:
    """python -m asyncps.tools.experiment.momentum_figure SPEC RUNS OUT.png [--reduced]."""
    p = argparse.ArgumentParser(prog="python -m asyncps.tools.experiment.momentum_figure", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", type=Path, help="the experiment spec (e.g. experiments/e6_async_momentum.yaml)")
    p.add_argument("runs", type=Path, help="the sweep's output directory (its --out)")
    p.add_argument("out", type=Path, help="the PNG to write")
    p.add_argument("--reduced", action="store_true", help="the spec's reduced points")
    p.add_argument("--x", choices=("updates", "pushes", "seconds"), default="updates",
                   help="x axis: updates applied, pushes per shard (sync and async compared by what they sent), or "
                        "seconds of training (error against wall clock: E8)")
    p.add_argument("--y", choices=("loss", "accuracy"), default="loss", help="y axis: test loss or test accuracy")
    p.add_argument("--only", action="append", default=[], metavar="VARIANT",
                   help="draw this variant's curve (repeatable; default: every variant)")
    args = p.parse_args(argv)
    try:
        drawn = loss_curves_figure(args.spec, args.runs, args.out, args.reduced, args.x, args.y, args.only)
    except ExperimentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.out}: {drawn} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
