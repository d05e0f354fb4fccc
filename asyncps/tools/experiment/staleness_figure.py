"""E7's figure: the normalized cost of staleness (updates to the target at λ over those at λ = 1)
against λ, one line per optimizer, one panel per network depth, mean ± sd over seeds and shard counts.

Dai et al. (ICLR 2019) plot the same quantity: staleness slows every optimizer, the momentum methods
(Adam, momentum SGD) more than SGD and Adagrad, and the deeper network more than the shallow one.
Each (seed, shard count) pair gives one ratio, against its own λ = 1 run; a run that never reached
the target is drawn as a cross at the top of its panel (its cost is above what the run measured).

    python -m asyncps.tools.experiment.staleness_figure experiments/e7_staleness_optimizers.yaml \\
        runs/e7_staleness_optimizers docs/figures/e7_staleness.png --table
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


def cost_table(costs: dict[str, dict[str, dict[int, list[float]]]]) -> str:
    """The normalized costs as a markdown table: a row per (depth, optimizer), a column per λ, each cell the
    mean ± sd of the runs that reached the target and how many of all never did."""
    lams = sorted({lam for opts in costs.values() for by_lam in opts.values() for lam in by_lam})
    lines = ["| network | optimizer | " + " | ".join(f"λ = {lam}" for lam in lams) + " |",
             "|---|---|" + "---|" * len(lams)]
    for depth, opts in costs.items():
        for opt, by_lam in sorted(opts.items()):
            cells = []
            for lam in lams:
                values = by_lam.get(lam, [])
                reached = [v for v in values if math.isfinite(v)]
                cell = (f"{statistics.fmean(reached):.2f} ± {statistics.stdev(reached):.2f}" if len(reached) > 1
                        else f"{reached[0]:.2f}" if reached else "—")
                missed = len(values) - len(reached)
                cells.append(cell + (f" ({missed}/{len(values)} never)" if missed else ""))
            lines.append(f"| {depth} | {opt} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def staleness_figure(spec_path: Path, runs: Path, out: Path, reduced: bool = False,
                     costs: dict[str, dict[str, dict[int, list[float]]]] | None = None) -> int:
    """Draw the normalized costs (mean ± sd bars over seeds and shard counts; `costs` when already read);
    the number of ratios drawn."""
    if costs is None:
        costs = normalized_costs(spec_path, runs, reduced)
    plt = _pyplot()
    from matplotlib import ticker
    fig, axes = plt.subplots(1, len(costs), figsize=(4.2 * len(costs), 3.8), sharey=True, squeeze=False)
    top = max((v for opts in costs.values() for lams in opts.values() for vs in lams.values() for v in vs
               if math.isfinite(v)), default=1.0) * 1.6
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
            for x in xs:  # one cross per (optimizer, λ) with runs that never reached: how many of how many
                missed = sum(not math.isfinite(v) for v in lams[x])
                if missed:
                    ax.scatter([x * shift], [top], marker="x", color=_color(i), s=30)
                    ax.annotate(f"{missed}/{len(lams[x])}", (x * shift, top), textcoords="offset points",
                                xytext=(0, 4 + 8 * (i % 2)), ha="center", fontsize=6, color=_color(i))
            drawn += sum(len(v) for v in lams.values())
        ax.axhline(1.0, color="black", lw=0.7, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)  # costs from 1 to ~20: the small ones stay readable
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(ticker.ScalarFormatter())
        ax.set_xlabel("λ (workers in turn; staleness λ - 1)")
        ax.set_title(f"MLP, {depth}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("updates to target at λ / at λ = 1")
    axes[0][0].legend(title="optimizer (x: runs that never\nreached the target, of all)", fontsize=7,
                      title_fontsize=7, loc="upper left")
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
    p.add_argument("--table", action="store_true",
                   help="also print the normalized costs as a markdown table (mean ± sd of the runs that reached "
                        "the target; how many never did)")
    args = p.parse_args(argv)
    try:
        costs = normalized_costs(args.spec, args.runs, args.reduced)
        drawn = staleness_figure(args.spec, args.runs, args.out, args.reduced, costs)
        if args.table:
            print(cost_table(costs))
    except (ExperimentError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.out}: {drawn} normalized costs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
