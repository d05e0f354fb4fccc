"""E11's figure, from a sweep's results.csv: (a) staleness against λ: the pushes' (versions), every pushed
row's on the sparse table, its hot and cold rows' apart, and the dense table's rows'; (b) the final test
accuracy against λ, sparse and dense; (c) the final test loss of each staleness policy at the largest λ on
the sparse table. Lines are means over seeds, dots every seed (the spread).

    python -m asyncps.tools.experiment.sparsity_figure experiments/e11_sparsity_staleness.yaml \\
        runs/e11_sparsity_staleness docs/figures/e11_sparsity.png
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncps.tools.experiment.errors import ExperimentError
from asyncps.tools.experiment.spec import load_spec
from asyncps.tools.experiment.tables import read_results
from asyncps.tools.report import _color, _pyplot, _save

#: The table a point trains, by its model spec: the sparse one unless it is the dense one of E11.
DENSE_MODEL = "recsys:rows=16"


@dataclass(frozen=True)
class Run:
    """One finished point as the figure sees it."""

    dense: bool
    workers: int
    policy: str
    metrics: dict[str, float]


def load_runs(spec_path: Path, runs: Path, reduced: bool = False) -> list[Run]:
    """The finished points of the sweep in `runs` (ExperimentError when none)."""
    records = read_results(runs)
    found = []
    for point in load_spec(spec_path, reduced=reduced).points():
        record = records.get(point.slug)
        if record is None or record.status != "ran":
            continue
        found.append(Run(point.config.model == DENSE_MODEL, point.config.num_workers, point.config.staleness_policy,
                         dict(record.metrics)))
    if not found:
        raise ExperimentError(f"no finished point of {spec_path} in {runs}")
    return found


def _series(ax: Any, runs: Sequence[Run], metric: str, label: str, color: str, marker: str = "o",
            style: str = "-") -> None:
    """Every seed as a dot, the mean over seeds as a line, against λ."""
    workers = sorted({r.workers for r in runs})
    means = []
    for w in workers:
        values = [r.metrics[metric] for r in runs if r.workers == w and not math.isnan(r.metrics[metric])]
        ax.scatter([w] * len(values), values, color=color, s=12, alpha=0.6, marker=marker)
        means.append(sum(values) / len(values) if values else math.nan)
    ax.plot(workers, means, color=color, lw=1.4, ls=style, marker=marker, ms=4, label=label, zorder=3)
    ax.set_xscale("log", base=2)
    ax.set_xticks(workers, [str(w) for w in workers])


def _staleness_panel(ax: Any, sparse: Sequence[Run], dense: Sequence[Run]) -> None:
    _series(ax, dense, "row_staleness_mean", "rows, dense table (16 rows)", _color(3))
    _series(ax, sparse, "staleness_mean", "pushes (versions), sparse: under the dense rows", "black", "s", "--")
    _series(ax, sparse, "row_staleness_hot_mean", "hot rows, sparse table", _color(1))
    _series(ax, sparse, "row_staleness_mean", "all rows, sparse table", _color(0))
    _series(ax, sparse, "row_staleness_cold_mean", "cold rows, sparse table", _color(2))
    ax.set_xlabel("λ workers")
    ax.set_ylabel("mean staleness (updates since read)")
    ax.set_title("(a) staleness: pushes vs rows")
    ax.legend(fontsize=7)


def _accuracy_panel(ax: Any, sparse: Sequence[Run], dense: Sequence[Run]) -> None:
    _series(ax, sparse, "final_accuracy", "sparse table (10,000 rows)", _color(0))
    _series(ax, dense, "final_accuracy", "dense table (16 rows)", _color(3))
    ax.set_xlabel("λ workers")
    ax.set_ylabel("final test accuracy")
    ax.set_title("(b) accuracy at equal updates")
    ax.legend(fontsize=7)


def _policy_panel(ax: Any, runs: Sequence[Run], workers: int) -> None:
    policies = sorted({r.policy for r in runs}, key=lambda p: (p != "none", p.removeprefix("row-"), p))
    for i, policy in enumerate(policies):
        values = [r.metrics["final_loss"] for r in runs if r.policy == policy]
        ax.bar(i, sum(values) / len(values), color=_color(1 if policy.startswith("row-") else 7), alpha=0.7)
        ax.scatter([i] * len(values), values, color="black", s=10, zorder=3)
    ax.set_xticks(range(len(policies)), policies, rotation=25, ha="right", fontsize=7)
    ax.set_ylabel("final test loss (lower is better)")
    ax.set_title(f"(c) policies, sparse, λ={workers}")
    low = min(r.metrics["final_loss"] for r in runs)
    ax.set_ylim(bottom=max(0.0, low - 0.05))


def sparsity_figure(spec_path: Path, runs: Path, out: Path, reduced: bool = False) -> int:
    """Draw E11's three panels from the sweep's results; the number of points drawn."""
    found = load_runs(spec_path, runs, reduced)
    plain = [r for r in found if r.policy == "none"]
    sparse, dense = [r for r in plain if not r.dense], [r for r in plain if r.dense]
    top = max(r.workers for r in found if not r.dense)
    policies = [r for r in found if not r.dense and r.workers == top]
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13.0, 4.2))
    _staleness_panel(axes[0], sparse, dense)
    _accuracy_panel(axes[1], sparse, dense)
    _policy_panel(axes[2], policies, top)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(f"E11 sparsity and staleness: recsys, Zipf ids, {len(found)} runs (dots: seeds)", fontsize=10)
    fig.tight_layout()
    _save(fig, out)
    return len(found)


def main(argv: Sequence[str] | None = None) -> int:
    """python -m asyncps.tools.experiment.sparsity_figure SPEC RUNS OUT.png [--reduced]."""
    p = argparse.ArgumentParser(prog="python -m asyncps.tools.experiment.sparsity_figure", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", type=Path, help="the experiment spec (experiments/e11_sparsity_staleness.yaml)")
    p.add_argument("runs", type=Path, help="the sweep's output directory (its --out)")
    p.add_argument("out", type=Path, help="the PNG to write")
    p.add_argument("--reduced", action="store_true", help="the spec's reduced grid (a --reduced sweep)")
    args = p.parse_args(argv)
    try:
        drawn = sparsity_figure(args.spec, args.runs, args.out, args.reduced)
    except ExperimentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.out}: {drawn} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
