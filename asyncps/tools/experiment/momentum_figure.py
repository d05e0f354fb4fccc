"""E6's figure: the test loss against updates of every run of a sweep, one colour per variant.

Asynchrony begets momentum (Mitliagkas et al. 2016) shows in the shape of these curves rather than
in any one number: the run that keeps the one-worker momentum overshoots (its loss climbs back after
the first updates), the run with the momentum lowered by 1 - 1/λ does not. The dashed line is the
target whose updates-to-reach the checks compare.

    python -m asyncps.tools.experiment.momentum_figure experiments/e6_async_momentum.yaml \\
        runs/e6_async_momentum docs/figures/e6_momentum.png
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from asyncps.rundir import EVAL_CSV, EvalRow, RunDir, read_rows
from asyncps.tools.experiment.errors import ExperimentError
from asyncps.tools.experiment.metrics import excess, optimal_test_loss
from asyncps.tools.experiment.spec import load_spec
from asyncps.tools.report import _color, _pyplot, _save


def loss_curves_figure(spec_path: Path, runs: Path, out: Path, reduced: bool = False) -> int:
    """Draw every finished point's test loss against updates (one colour per variant label, one
    line per seed); the number of runs drawn."""
    spec = load_spec(spec_path, reduced=reduced)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    colours: dict[str, str] = {}
    drawn = 0
    excess_target = spec.target is not None and spec.target.metric == "excess_loss"
    for point in spec.points():
        eval_csv = RunDir(runs / point.slug).evals
        if not eval_csv.exists():
            continue
        rows = read_rows(eval_csv, EvalRow)
        if excess_target:  # each seed's own data: curves drawn above that data's optimum
            rows = excess(rows, optimal_test_loss(runs / point.slug))
        variant = str(point.axes.get("variant", point.label))
        first = variant not in colours
        colour = colours.setdefault(variant, _color(len(colours)))
        ax.plot([r.updates for r in rows], [r.loss for r in rows], color=colour, lw=1.2, alpha=0.8,
                label=variant if first else None)
        drawn += 1
    if not drawn:
        raise ExperimentError(f"no {EVAL_CSV} under {runs} for the points of {spec_path}")
    if spec.target is not None and spec.target.metric != "accuracy":
        ax.axhline(spec.target.value, color="black", ls="--", lw=0.8, label=f"target: {spec.target.describe()}")
    ax.set_xlabel("updates applied")
    ax.set_ylabel("test loss above the optimum's" if excess_target else "test loss")
    ax.set_title(f"{spec.name}: test loss per run ({drawn} runs)")
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
    args = p.parse_args(argv)
    try:
        drawn = loss_curves_figure(args.spec, args.runs, args.out, args.reduced)
    except ExperimentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.out}: {drawn} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
