"""E7's figure: the normalized cost of staleness (updates to the target at λ over those at λ = 1)
against λ, one line per optimizer, one panel per network depth, mean ± sd over seeds and shard counts.

Dai et al. (ICLR 2019) plot the same quantity: staleness slows every optimizer, the momentum methods
(Adam, momentum SGD) more than SGD and Adagrad, and the deeper network more than the shallow one.
Each (seed, shard count) pair gives one ratio, against its own λ = 1 run; a run that never reached
the target is drawn as a cross at the top of its panel (its cost is above what the run measured).

    python -m asyncps.tools.experiment.staleness_figure experiments/e7_staleness_optimizers.yaml \\
        runs/e7_staleness_optimizers docs/figures/e7_staleness.png
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from asyncps.tools.experiment.errors import ExperimentError
from asyncps.tools.experiment.spec import load_spec
from asyncps.tools.experiment.tables import read_results
from asyncps.tools.report import _color, _pyplot, _save

METRIC = "updates_to_target"


def normalized_costs(spec_path: Path, runs: Path, reduced: bool = False,
                     ) -> dict[str, dict[str, dict[int, list[float]]]]:
    """depth label -> optimizer label -> λ -> the normalized costs of every (seed, num_ps) pair that
    has both runs (NaN where the λ run never reached the target)."""
    spec = load_spec(spec_path, reduced=reduced)
    results = read_results(runs)
    if not results:
        raise ExperimentError(f"no results.csv under {runs}: run the sweep first")
    cost: dict[tuple[str, str, int, int, int], float] = {}
    for point in spec.points():
        record = results.get(point.slug)
        if record is None or record.status == "failed":
            continue
        key = (str(point.axes["depth"]), str(point.axes["opt"]), point.config.num_workers,
               point.config.seed, point.config.num_ps)
        cost[key] = record.metrics[METRIC]
    out: dict[str, dict[str, dict[int, list[float]]]] = {}
    for (depth, opt, lam, seed, num_ps), value in sorted(cost.items()):
        base = cost.get((depth, opt, 1, seed, num_ps), math.nan)
        if math.isnan(base) or base <= 0:
            continue
        out.setdefault(depth, {}).setdefault(opt, {}).setdefault(lam, []).append(value / base)
    if not out:
        raise ExperimentError(f"no run of {spec_path} under {runs} has its λ = 1 baseline")
    return out


def staleness_figure(spec_path: Path, runs: Path, out: Path, reduced: bool = False) -> int:
    """Draw the normalized costs (mean ± sd bars over seeds and shard counts); the number of ratios drawn."""
    costs = normalized_costs(spec_path, runs, reduced)
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(costs), figsize=(4.2 * len(costs), 3.8), sharey=True, squeeze=False)
    top = max((v for opts in costs.values() for lams in opts.values() for vs in lams.values() for v in vs
               if math.isfinite(v)), default=1.0) * 1.15
    drawn = 0
    for ax, (depth, opts) in zip(axes[0], costs.items(), strict=True):
        for i, (opt, lams) in enumerate(opts.items()):
            xs = sorted(lams)
            finite = [[v for v in lams[x] if math.isfinite(v)] for x in xs]
            means = [statistics.fmean(v) if v else math.nan for v in finite]
            sds = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in finite]
            shift = 1 + 0.04 * (i - (len(opts) - 1) / 2)  # side by side on the log axis
            ax.errorbar([x * shift for x in xs], means, yerr=sds, color=_color(i), marker="o", ms=4, lw=1.3,
                        capsize=3, label=opt)
            missed = [x * shift for x in xs for v in lams[x] if not math.isfinite(v)]
            if missed:
                ax.scatter(missed, [top] * len(missed), marker="x", color=_color(i), s=30)
            drawn += sum(len(v) for v in lams.values())
        ax.axhline(1.0, color="black", lw=0.7, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("λ (workers in turn; staleness λ - 1)")
        ax.set_title(f"MLP, {depth}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("updates to target at λ / at λ = 1")
    axes[0][0].legend(title="optimizer (x: target not reached)")
    fig.suptitle(f"{load_spec(spec_path, reduced=reduced).name}: normalized cost of staleness "
                 "(mean ± sd over seeds and shard counts)")
    fig.tight_layout()
    _save(fig, out)
    plt.close(fig)
    return drawn


def main(argv: Sequence[str] | None = None) -> int:
    """python -m asyncps.tools.experiment.staleness_figure SPEC RUNS OUT.png [--reduced]."""
    p = argparse.ArgumentParser(prog="python -m asyncps.tools.experiment.staleness_figure", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", type=Path, help="the experiment spec (experiments/e7_staleness_optimizers.yaml)")
    p.add_argument("runs", type=Path, help="the sweep's output directory (its --out)")
    p.add_argument("out", type=Path, help="the PNG to write")
    p.add_argument("--reduced", action="store_true", help="the spec's reduced points")
    args = p.parse_args(argv)
    try:
        drawn = staleness_figure(args.spec, args.runs, args.out, args.reduced)
    except (ExperimentError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.out}: {drawn} normalized costs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
