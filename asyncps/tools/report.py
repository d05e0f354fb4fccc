"""`asyncps report DIR`: figures and report.md for a run directory or a sweep of them.

Figures (matplotlib, Agg backend, small PNGs):
- `curves.png`: evaluation accuracy and loss against wall time and against updates, runs overlaid;
- `staleness.png`: the staleness histogram of every setting (its seeds pooled);
- `timeline.png`: a Gantt chart of each worker's steps (compute, push/pull round trip, time held
  back by the consistency model) over a short window, one panel per setting (its first seed: sync vs async);
- `scaling.png`: updates/s, mean staleness, idle share and final quality (mean ± sd over seeds) against the number of
  workers λ (log axis) or the one swept numeric setting, a line per variant and shard count; else a bar per
  setting. Series are named readably (`async, 2 shards`); panels zero in every run are left out; a panel
  whose values span more than two decades is drawn on a log axis.

`python -m asyncps.tools.report --stale-gradient-figure PATH` draws the teaching picture of a stale
gradient on a 1-D quadratic (no run needed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from asyncps.rundir import (
    UNFINISHED,
    EvalRow,
    PushRow,
    RunConfigRecord,
    RunDir,
    RunDirError,
    RunSummary,
    StepRow,
    is_run_dir,
    load_summary,
    read_rows,
)
from asyncps.tools.experiment import RESULTS_MD, ExperimentError, markdown_table, read_results, run_metrics
from asyncps.tools.experiment.tables import TUNE_CSV

#: Colours of the timeline's segment kinds (and their legend names).
SEGMENTS: dict[str, tuple[str, str]] = {
    "pull_s": ("#55A868", "pull (first step)"),
    "compute_s": ("#4C72B0", "compute gradient"),
    "push_s": ("#F0A04B", "push + pull round trip"),
    "wait_s": ("#D65F5F", "held back (sync / SSP wait)"),
}
DROPPED_COLOR = "#A9BEDF"
TARGET_METRICS = ("time_to_target_s", "updates_to_target")
DPI = 100


@dataclass
class RunData:
    """One run directory's telemetry, read on demand."""

    label: str
    path: Path
    summary: RunSummary = field(repr=False)
    config: dict[str, Any] = field(repr=False)  # the RunConfig fields of config.json
    target: dict[str, float] = field(default_factory=dict)  # time/updates to the sweep's target (results.csv)

    @classmethod
    def load(cls, path: Path, label: str = "", target: dict[str, float] | None = None) -> RunData:
        """Read summary.json (or, for an unfinished or crashed run, what its CSVs say) and config.json;
        the label defaults to a description of the run."""
        summary = load_summary(path)
        record = RunConfigRecord.load_if_present(path)
        config = record.run if record is not None else {}
        return cls(label or describe_run(summary, config), path, summary, config, dict(target or {}))

    @cached_property
    def evals(self) -> list[EvalRow]:
        """eval.csv."""
        return read_rows(RunDir(self.path).evals, EvalRow)

    @cached_property
    def steps(self) -> list[StepRow]:
        """timeline.csv."""
        return read_rows(RunDir(self.path).timeline, StepRow)

    @cached_property
    def dropped_steps(self) -> set[tuple[int, int]]:
        """(worker, step) of every step whose gradient some shard dropped."""
        return {(r.worker, r.step) for r in read_rows(RunDir(self.path).pushes, PushRow) if not r.accepted}

    @cached_property
    def metrics(self) -> dict[str, float]:
        """The sweep metrics of this run (experiment.run_metrics; the target's from results.csv)."""
        return {**run_metrics(self.path), **self.target}

    def setting(self, name: str) -> Any:
        """A RunConfig field of the run (from config.json, else what the summary records of it)."""
        return self.config.get(name, self.summary.settings().get(name))


def describe_run(summary: RunSummary, config: dict[str, Any]) -> str:
    """E.g. `sync +1 backup, 4 workers` or `async lr-scale, 8 workers`."""
    settings = {**summary.settings(), **config}
    # The mode is a spec (sync:backup=1); runs recorded before specs kept its parameters apart.
    mode, _, params = str(settings["mode"]).partition(":")
    spec = dict(item.split("=", 1) for item in params.split(",") if "=" in item)
    text = mode
    backup = spec.get("backup", settings.get("backup_workers"))
    if mode == "sync" and backup and str(backup) != "0":
        text += f" +{backup} backup"
    if mode == "ssp":
        text += f" s={spec.get('bound', settings.get('staleness_bound', '?'))}"
    policy = settings.get("staleness_policy", "none")
    if policy and policy != "none":
        text += f" {policy}"
    return f"{text}, {settings['num_workers']} workers"


def discover_runs(path: Path) -> list[RunData]:
    """The run at `path`, or every run directory inside it (labelled from results.csv if present);
    finished or not."""
    if is_run_dir(path):
        return [RunData.load(path)]
    if not path.is_dir():
        raise ExperimentError(f"{path} is not a directory")
    results = read_results(path)

    def label(point: str) -> str:
        record = results.get(point)
        if record is None:
            return ""
        return f"{record.label} ({record.tuned})" if record.tuned else record.label

    def target(point: str) -> dict[str, float]:
        record = results.get(point)
        if record is None:
            return {}
        return {k: record.metrics[k] for k in TARGET_METRICS if not math.isnan(record.metrics[k])}

    runs = [RunData.load(d, label(d.name), target(d.name)) for d in sorted(path.iterdir())
            if d.is_dir() and is_run_dir(d)]
    if not runs:
        raise ExperimentError(f"no run directories (with summary.json or config.json) in {path}")
    return runs


# -- plotting ------------------------------------------------------------------------------------
def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 9, "axes.titlesize": 9, "axes.labelsize": 9, "legend.fontsize": 8,
                         "axes.spines.top": False, "axes.spines.right": False})
    return plt


def _color(i: int) -> str:
    palette = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C",
               "#CCB974", "#64B5CD"]
    return palette[i % len(palette)]


def _save(fig: Any, path: Path) -> Path:
    """Write the figure as a small PNG: rendered by matplotlib, then reduced to a 128-colour palette
    (these are flat-colour line and bar charts: a third of the size, no visible change)."""
    import io

    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight", facecolor="white")
    _pyplot().close(fig)
    buffer.seek(0)
    with Image.open(buffer) as image:
        palette = image.convert("RGB").quantize(colors=128, method=Image.Quantize.MEDIANCUT)
        palette.save(path, format="PNG", optimize=True)
    return path


def _figure_legend(fig: Any, handles: list[Any], labels: list[str]) -> None:
    """Lay the panels out and put one legend for the whole figure under them (fewer columns for long labels)."""
    longest = max((len(label) for label in labels), default=0)
    ncol = max(1, min(len(labels), 4 if longest <= 22 else 3 if longest <= 32 else 2))
    rows = math.ceil(len(labels) / ncol)
    fig.tight_layout(rect=(0, 0.02 + 0.035 * rows, 1, 1))
    fig.legend(handles, labels, loc="lower center", ncol=ncol, frameon=False, bbox_to_anchor=(0.5, -0.01))


def plot_curves(runs: Sequence[RunData], path: Path) -> Path | None:
    """Accuracy and loss against wall time and against updates, one line per run."""
    runs = [r for r in runs if r.evals]
    if not runs:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(9, 6.2), sharex="col")
    losses = [e.loss for r in runs for e in r.evals if e.loss > 0 and math.isfinite(e.loss)]
    log_loss = bool(losses) and max(losses) / min(losses) > 20
    for i, run in enumerate(runs):
        x_columns = ([e.elapsed_s for e in run.evals], [float(e.updates) for e in run.evals])
        for col, xs in enumerate(x_columns):
            axes[0][col].plot(xs, [e.accuracy for e in run.evals], color=_color(i), marker=".", ms=3, lw=1.3,
                              label=run.label)
            axes[1][col].plot(xs, [e.loss for e in run.evals], color=_color(i), marker=".", ms=3, lw=1.3)
    for col, xlabel in enumerate(("wall time since the first update (s)", "updates applied")):
        axes[1][col].set_xlabel(xlabel)
        if log_loss:
            axes[1][col].set_yscale("log")
    axes[0][0].set_ylabel("test accuracy")
    axes[1][0].set_ylabel("test loss")
    axes[0][0].set_title("against wall time")
    axes[0][1].set_title("against updates")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    _figure_legend(fig, handles, labels)
    return _save(fig, path)


def _histogram(run: RunData) -> list[tuple[int, int]]:
    return sorted(run.summary.staleness.histogram.items())


def pooled_histogram(runs: Sequence[RunData]) -> list[tuple[int, int]]:
    """The staleness histograms of several runs (the seeds of one setting) added up."""
    counts: dict[int, int] = {}
    for run in runs:
        for k, c in _histogram(run):
            counts[k] = counts.get(k, 0) + c
    return sorted(counts.items())


def _quantile(hist: Sequence[tuple[int, int]], q: float) -> int:
    """The smallest staleness with at least a share q of the pushes at or below it."""
    total, seen = sum(c for _, c in hist), 0
    for k, c in hist:
        seen += c
        if seen >= q * total:
            return k
    return hist[-1][0]


def plot_staleness(runs: Sequence[RunData], path: Path) -> Path | None:
    """One staleness histogram per setting (share of pushes, the seeds of a setting pooled), mean marked;
    a row per shard count when there are up to five settings of each."""
    groups = [(name, members) for name, members in group_by_label_without_seed([r for r in runs if _histogram(r)])]
    if not groups:
        return None
    plt = _pyplot()
    # a mode every panel shares, and the seeds pooled, go in the figure's title, not in every panel's
    firsts = {name.split(", ")[0] for name, _ in groups}
    common = firsts.pop() if len(firsts) == 1 and all(", " in name for name, _ in groups) else ""
    if common:
        groups = [(name[len(common) + 2:], members) for name, members in groups]
    seeds = {len(members) for _, members in groups}
    cols = min(5 if len(groups) % 5 == 0 else 4, len(groups))
    rows = math.ceil(len(groups) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.4 * cols + 0.6, 2.3 * rows + 0.3), squeeze=False)
    for i, (name, members) in enumerate(groups):
        ax = axes[i // cols][i % cols]
        hist = pooled_histogram(members)
        total = sum(c for _, c in hist)
        right = max(_quantile(hist, 0.98), 4)  # show 98% of the pushes; the tail's end is in the title
        shown = [(k, c) for k, c in hist if k <= right]
        ax.bar([k for k, _ in shown], [100 * c / total for _, c in shown], color=_color(i % cols),
               width=0.8 if right <= 40 else 1.0)
        ax.set_xlim(-0.6, right + 0.6)
        mean = sum(k * c for k, c in hist) / total
        ax.axvline(mean, color="black", ls="--", lw=1)
        ax.set_title(f"{name}\nmean {mean:.3g}, p95 {_quantile(hist, 0.95)}, max {hist[-1][0]}")
        ax.set_xlabel("staleness (updates)")
        ax.xaxis.get_major_locator().set_params(integer=True)
        if i % cols == 0:
            ax.set_ylabel("% of pushes")
        ax.grid(alpha=0.3, axis="y")
    for j in range(len(groups), rows * cols):
        axes[j // cols][j % cols].set_visible(False)
    pooled = f"the {max(seeds)} seeds of a setting pooled, " if seeds != {1} else ""
    fig.suptitle(f"{common + ': ' if common else ''}staleness of every push ({pooled}98% of the pushes shown; "
                 "dashed: the mean)", fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


def timeline_window(steps: Sequence[StepRow], window_s: float) -> tuple[float, float]:
    """A window of window_s seconds in the steady state: after every worker's first step (which
    includes TensorFlow's tracing), 30% of the way into what is left of the run."""
    first: dict[int, StepRow] = {}
    for s in steps:
        if s.worker not in first or s.step < first[s.worker].step:
            first[s.worker] = s
    ready = max(s.end for s in first.values())
    t1 = max(s.end for s in steps)
    start = ready + 0.3 * max(0.0, t1 - ready - window_s)
    return start, start + window_s


def timeline_runs(runs: Sequence[RunData], max_runs: int) -> list[tuple[str, RunData]]:
    """The runs a timeline figure shows, named readably: the first seed of each setting, and of the first shard
    count only when all shard counts would not fit in max_runs panels."""
    groups = group_by_label_without_seed(runs)
    if len(groups) > max_runs:
        first = min(int(r.setting("num_ps") or 1) for r in runs)
        groups = [(n, m) for n, m in groups if int(m[0].setting("num_ps") or 1) == first] or groups
    return [(name, members[0]) for name, members in groups[:max_runs]]


def plot_timeline(runs: Sequence[RunData], path: Path, window_s: float = 2.0, max_runs: int = 4) -> Path | None:
    """Per-worker Gantt charts (one panel per run: timeline_runs) over a window of window_s seconds."""
    picked = timeline_runs([r for r in runs if r.steps], max_runs)
    if not picked:
        return None
    runs = [run for _, run in picked]
    plt = _pyplot()
    from matplotlib.patches import Patch

    heights = [max(2, len({s.worker for s in r.steps})) for r in runs]
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 0.3 * sum(heights) + 0.8 * len(runs) + 0.6),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    any_dropped = False
    for ax, (name, run) in zip((a[0] for a in axes), picked, strict=True):
        lo, hi = timeline_window(run.steps, window_s)
        workers = sorted({s.worker for s in run.steps})
        dropped = run.dropped_steps
        for row, worker in enumerate(workers):
            bars: dict[str, list[tuple[float, float]]] = {k: [] for k in SEGMENTS}
            faded: list[tuple[float, float]] = []
            for s in run.steps:
                if s.worker != worker or s.end < lo or s.start - s.pull_s > hi:
                    continue
                if s.pull_s > 0:
                    bars["pull_s"].append((s.start - s.pull_s - lo, s.pull_s))
                t = s.start - lo
                target = faded if (s.worker, s.step) in dropped else bars["compute_s"]
                target.append((t, s.compute_s))
                t += s.compute_s
                bars["push_s"].append((t, s.push_s))
                bars["wait_s"].append((t + s.push_s, s.wait_s))
            for kind, (color, _) in SEGMENTS.items():
                ax.broken_barh(bars[kind], (row - 0.38, 0.76), facecolors=color, edgecolor="white", linewidth=0.4)
            if faded:
                any_dropped = True
                ax.broken_barh(faded, (row - 0.38, 0.76), facecolors=DROPPED_COLOR, edgecolor="#4C72B0",
                               hatch="////", linewidth=0.4)
        ax.set_yticks(range(len(workers)), [f"worker {w}" for w in workers])
        ax.set_ylim(-0.6, len(workers) - 0.4)
        ax.invert_yaxis()
        ax.set_xlim(0, hi - lo)
        m = run.metrics
        ax.set_title(f"{name}: {m['updates_per_s']:.1f} updates/s, {m['gradients_per_s']:.1f} gradients/s, "
                     f"idle {m['idle_pct']:.0f}%", loc="left")
    axes[-1][0].set_xlabel(f"seconds (a {window_s:g} s window of each run, after every worker's first step)")
    handles = [Patch(facecolor=c, label=name) for c, name in SEGMENTS.values()]
    if any_dropped:
        handles.append(Patch(facecolor=DROPPED_COLOR, edgecolor="#4C72B0", hatch="////",
                             label="gradient dropped (late)"))
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False, bbox_to_anchor=(0.5, -0.01))
    return _save(fig, path)


_SCALING_PANELS = (
    ("updates_per_s", "updates / s"),
    ("staleness_mean", "mean staleness (updates)"),
    ("idle_pct", "idle % (held back by sync / SSP)"),
)


def _quality_panel(runs: Sequence[RunData]) -> tuple[str, str]:
    if any(not math.isnan(r.metrics["optimality_gap"]) for r in runs):
        return "optimality_gap", "final optimality gap (train loss - optimum)"
    if runs and all(math.isnan(r.metrics["final_accuracy"]) for r in runs):  # not classification
        return "final_loss", "final test loss"
    return "final_accuracy", "final test accuracy"


def _varying(runs: Sequence[RunData]) -> list[str]:
    """The run settings whose values differ between runs (seed aside)."""
    keys = sorted({k for r in runs for k in r.config})
    return [k for k in keys if k != "seed" and len({json.dumps(r.config.get(k), sort_keys=True) for r in runs}) > 1]


#: x-axis names of the settings a scaling figure may be drawn against.
AXIS_NAMES = {"num_workers": "workers λ", "num_ps": "parameter-server shards",
              "staleness_bound": "SSP staleness bound s", "backup_workers": "backup workers"}


def _follows(runs: Sequence[RunData], key: str, x_key: str) -> bool:
    """Whether setting `key` has one value per value of `x_key` (e.g. a mode spec `ssp:bound=S` per bound)."""
    values: dict[str, set[str]] = {}
    for r in runs:
        values.setdefault(json.dumps(r.config.get(x_key)), set()).add(json.dumps(r.config.get(key), sort_keys=True))
    return all(len(v) == 1 for v in values.values())


def scaling_axis(runs: Sequence[RunData]) -> str | None:
    """The numeric setting to put on the x axis: num_workers if it varies, else the one varying numeric
    setting (e.g. staleness_bound) that all other varying settings follow from, the shard count aside
    (shard counts are then series); None means one bar per setting."""
    varying = _varying(runs)
    if "num_workers" in varying:
        return "num_workers"
    numeric = [k for k in varying if all(isinstance(r.config.get(k), (int, float)) for r in runs)]
    for key in [k for k in numeric if k != "num_ps"] or numeric:
        if all(k in (key, "num_ps") or _follows(runs, k, key) for k in varying):
            return key
    return None


_SEED_PART = re.compile(r"seed=\d+")
_SHARDS_SUFFIX = re.compile(r", \d+ shards?$")
LINE_STYLES = ("-", "--", ":", "-.")
_WORKERS_TOKEN = re.compile(r"λ\s*=\s*\d+")
_MODE_WORD = re.compile(r"(a?sync|ssp|local-sgd)\b")


def readable_label(parts: Sequence[str], run: RunData) -> str:
    """A short name from a run's label parts (seed and x-value parts already removed): `num_ps=2` reads
    `2 shards` (last), `staleness_policy=lr-scale` reads `lr-scale`, other `key=value` parts stay; the run's
    mode leads unless a part names it. E.g. `async, 2 shards`, `async lr-scale, 1 shard`, `sync+1 backup, 1 shard`."""
    named: list[str] = []
    shards: list[str] = []
    policy = False
    for part in (p.strip() for p in parts):
        key, eq, value = part.partition("=")
        if not part or _SEED_PART.fullmatch(part):
            continue
        if eq and key == "num_ps":
            shards.append(f"{value} shard{'' if value == '1' else 's'}")
        elif eq and key == "staleness_policy":
            if value != "none":
                policy = policy or not named
                named.append(value)
        else:
            named.append(part)
    if not any(_MODE_WORD.match(p) for p in named):
        mode = str(run.setting("mode") or "async").partition(":")[0]
        if named and (policy or ("=" not in named[0] and " " not in named[0])):
            named[0] = f"{mode} {named[0]}"  # a one-word variant or policy: `async lr-scale`
        else:
            named.insert(0, mode)
    return ", ".join(named + shards)


def _label_parts(run: RunData) -> list[str]:
    """The parts of a run's label (the spec's, from results.csv) without its seed part."""
    return [p for p in run.label.split(", ") if not _SEED_PART.fullmatch(p)]


def _series(runs: Sequence[RunData], x_key: str) -> list[str]:
    """A readable series name per run (readable_label): its label (the spec's, from results.csv) without the
    seed and without what names the x value (a label part in one-to-one correspondence with x_key, or a
    `λ=N` word when x is the worker count); runs without comparable labels are named by their varying
    settings other than x_key and those that follow from it (one value per x, e.g. a step time scaled with λ)."""
    parts = [run.label.split(", ") for run in runs]
    if runs and all(run.label for run in runs) and len({len(p) for p in parts}) == 1:
        keep = []
        for j in range(len(parts[0])):
            values = [p[j] for p in parts]
            if all(_SEED_PART.fullmatch(v) for v in values):
                continue
            pairs = {(v, float(run.config[x_key])) for v, run in zip(values, runs, strict=True)}
            if len(pairs) == len({v for v, _ in pairs}) == len({x for _, x in pairs}):
                continue  # this axis names the x value
            keep.append(j)
        named = [[p[j] for j in keep] for p in parts]
        if x_key == "num_workers":
            named = [[" ".join(_WORKERS_TOKEN.sub("", v).split()) for v in p] for p in named]
        return [readable_label(p, run) for p, run in zip(named, runs, strict=True)]

    others = [k for k in _varying(runs) if k != x_key and not _follows(runs, k, x_key)]
    return [readable_label([f"{k}={r.config.get(k)}" for k in others], r) for r in runs]


def group_by_label_without_seed(runs: Sequence[RunData]) -> list[tuple[str, list[RunData]]]:
    """Runs grouped by their label with any `seed=N` part removed (repeats of one setting), in order, each
    named readably (readable_label)."""
    groups: dict[str, list[RunData]] = {}
    for run in runs:
        groups.setdefault(", ".join(_label_parts(run)) or run.label, []).append(run)
    return [(readable_label(_label_parts(members[0]), members[0]) if members[0].label else name, members)
            for name, members in groups.items()]


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """The mean and sample standard deviation of the finite values (sd 0 for one; NaNs for none)."""
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return math.nan, math.nan
    mean = sum(finite) / len(finite)
    if len(finite) == 1:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in finite) / (len(finite) - 1))


def _log_workers_axis(ax: Any, xs: Sequence[float]) -> None:
    """λ on a base-2 log axis, ticked at the swept values."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.minorticks_off()
    ax.set_xlim(min(xs) / 1.25, max(xs) * 1.25)


def log_x_axis(x_key: str, xs: Sequence[float]) -> bool:
    """Whether the scaling figure's x axis is logarithmic: for a worker count λ (swept as 1, 4, 16, 64, 256, a
    linear axis crushes the small counts together)."""
    return x_key == "num_workers" and len(xs) > 1 and min(xs) > 0


def log_y_axis(values: Sequence[float]) -> bool:
    """Whether a scaling panel's y axis is logarithmic: positive values over more than two decades (an
    optimality gap of 0.003 at λ = 4 and 2.3 at λ = 256), which a linear axis would flatten to zero."""
    finite = [v for v in values if not math.isnan(v)]
    return bool(finite) and min(finite) > 0 and max(finite) / min(finite) > 100


def scaling_panels(runs: Sequence[RunData]) -> list[tuple[str, str]]:
    """The scaling figure's panels, (metric, title): those where some run measured something other than
    zero (the staleness of sync runs or the idle time of async ones would be an empty panel)."""
    panels = [*_SCALING_PANELS, _quality_panel(runs)]
    if any(r.target for r in runs):
        panels += [("updates_to_target", "updates to the target"), ("time_to_target_s", "seconds to the target")]
    return [(m, t) for m, t in panels if any(not math.isnan(r.metrics[m]) and r.metrics[m] != 0 for r in runs)]


def plot_scaling(runs: Sequence[RunData], path: Path) -> Path | None:
    """Updates/s, staleness, idle share and quality against workers λ (log axis) or the one swept numeric
    setting (e.g. the SSP bound), one series per label of the spec: the mean over seeds, with a band of
    ± one standard deviation; else one bar per label (mean, ± sd whiskers). Panels with no value but zero are
    left out."""
    if not runs:
        return None
    plt = _pyplot()
    panels = scaling_panels(runs)
    if not panels:
        return None
    rows = math.ceil(len(panels) / 2)
    x_key = scaling_axis(runs)
    if x_key is not None:
        xs_all = sorted({float(r.config[x_key]) for r in runs})
        log_x = log_x_axis(x_key, xs_all)
        fig, axes = plt.subplots(rows, 2, figsize=(9, 3.1 * rows), squeeze=False)
        series = _series(runs, x_key)
        names = list(dict.fromkeys(series))
        # one colour per variant, one line style per shard count (`…, 2 shards` dashed)
        variants = list(dict.fromkeys(_SHARDS_SUFFIX.sub("", n) for n in names))
        shard_counts = list(dict.fromkeys(m.group(0) for n in names if (m := _SHARDS_SUFFIX.search(n))))
        styles = {n: (_color(variants.index(_SHARDS_SUFFIX.sub("", n))),
                      LINE_STYLES[shard_counts.index(m.group(0)) % len(LINE_STYLES)]
                      if (m := _SHARDS_SUFFIX.search(n)) else "-") for n in names}
        seeds = max(sum(1 for r, s in zip(runs, series, strict=True) if s == name and float(r.config[x_key]) == x)
                    for name in names for x in xs_all)
        for ax, (metric, title) in zip(axes.flat, panels, strict=False):
            log_y = log_y_axis([r.metrics[metric] for r in runs])
            for name in names:
                points: dict[float, list[float]] = {}
                for run, s in zip(runs, series, strict=True):
                    if s == name:
                        points.setdefault(float(run.config[x_key]), []).append(run.metrics[metric])
                stats = [(x, *mean_sd(points[x])) for x in sorted(points)]
                stats = [(x, m, sd) for x, m, sd in stats if not math.isnan(m)]
                if not stats:
                    continue
                xs, means, sds = zip(*stats, strict=True)
                color, style = styles[name]
                ax.plot(xs, means, marker="o", ms=4, color=color, ls=style, label=name)
                if any(sd > 0 for sd in sds):
                    ax.fill_between(xs, [m - sd if m - sd > 0 or not log_y else m / 10
                                         for m, sd in zip(means, sds, strict=True)],
                                    [m + sd for m, sd in zip(means, sds, strict=True)],
                                    color=color, alpha=0.15, lw=0)
            if (x_key == "num_workers" and metric == "staleness_mean"
                    and any(r.setting("mode") == "async" for r in runs)):
                (reference,) = ax.plot(xs_all, [w - 1 for w in xs_all], ls="--", color="black", lw=1)
                ax.legend([reference], ["λ-1 (Zhang et al. 2016)"], loc="upper left", frameon=False)
            if log_y:
                ax.set_yscale("log")
                title += " (log scale)"
            else:
                top = ax.get_ylim()[1]
                ax.set_ylim(0, top * 1.08 if top > 0 else 1.0)  # from zero, with room above the highest point
            ax.set_title(title)
            ax.set_xlabel(AXIS_NAMES.get(x_key, x_key) + (" (log scale)" if log_x else ""))
            if log_x:
                _log_workers_axis(ax, xs_all)
            else:
                ax.set_xticks(xs_all, [f"{x:g}" for x in xs_all])
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(panels):]:
            fig.delaxes(ax)
        handles, labels = axes[0][0].get_legend_handles_labels()
        if seeds > 1:
            labels = [*labels, f"band: mean ± sd over {seeds} seeds"]
            handles = [*handles, plt.matplotlib.patches.Patch(color="#999999", alpha=0.3)]
        _figure_legend(fig, handles, labels)
    else:
        groups = group_by_label_without_seed(runs)
        sizes = {len(members) for _, members in groups}
        labels = [name + (f" (n={len(members)})" if len(sizes) > 1 and len(members) > 1 else "")
                  for name, members in groups]
        fig, axes = plt.subplots(rows, 2, figsize=(9, 0.8 + (0.6 + 0.5 * len(groups)) * rows), sharey=True,
                                 squeeze=False)
        ys = list(range(len(groups)))
        # one colour per variant; a second (third) shard count hatched
        variants = list(dict.fromkeys(_SHARDS_SUFFIX.sub("", name) for name, _ in groups))
        shard_counts = list(dict.fromkeys(m.group(0) for name, _ in groups if (m := _SHARDS_SUFFIX.search(name))))
        colors = [_color(variants.index(_SHARDS_SUFFIX.sub("", name))) for name, _ in groups]
        hatches = ["" if not (m := _SHARDS_SUFFIX.search(name)) or shard_counts.index(m.group(0)) == 0
                   else "//" if shard_counts.index(m.group(0)) == 1 else ".." for name, _ in groups]
        for ax, (metric, title) in zip(axes.flat, panels, strict=False):
            spreads = [mean_sd([r.metrics[metric] for r in members]) for _, members in groups]
            values = [0.0 if math.isnan(m) else m for m, _ in spreads]
            errors = [0 if math.isnan(sd) else sd for _, sd in spreads]
            # a diverged run (a gap of 1e12 beside 0.1) would flatten the others: a log axis over two decades
            log_x = log_y_axis([r.metrics[metric] for r in runs])
            floor = min(v for v in values if v > 0) / 3 if log_x else 0.0
            xerr: Any = errors if any(errors) else None
            if log_x and xerr is not None:  # the bar starts at the floor: a whisker below it is cut there
                xerr = [[min(sd, v - floor) for v, sd in zip(values, errors, strict=True)], errors]
            bars = ax.barh(ys, [max(v - floor, 0.0) for v in values], left=floor, color=colors,
                           xerr=xerr, error_kw={"lw": 1, "capsize": 3})
            if log_x:
                ax.set_xscale("log")
                ax.set_xlim(left=floor)
                title += " (log scale)"
            for bar, hatch in zip(bars, hatches, strict=True):
                bar.set_hatch(hatch)
            for y, (v, sd) in zip(ys, spreads, strict=True):
                text = f" {v:.3g}" + (f" ± {sd:.2g}" if sd > 0 else "")
                ax.text(floor if math.isnan(v) else v + (0 if math.isnan(sd) else sd), y, text, va="center",
                        fontsize=8)
            ax.set_title(title)
            ax.margins(x=0.25)
            ax.grid(alpha=0.3, axis="x")
        for ax in list(axes.flat)[len(panels):]:
            fig.delaxes(ax)
        axes[0][0].set_yticks(ys, labels)
        axes[0][0].invert_yaxis()  # the y axis is shared: first run on top
        workers = sorted({str(r.setting("num_workers")) for r in runs})
        over = f"{max(sizes)} seeds" if len(sizes) == 1 else "seeds"
        spread = f" (bars: mean ± sd over {over})" if max(sizes) > 1 else ""
        fig.suptitle(f"{', '.join(workers)} workers per run{spread}", fontsize=9)
        fig.tight_layout()
    return _save(fig, path)


# -- the stale-gradient teaching figure ----------------------------------------------------------
def delayed_gd(eta: float, tau: int, steps: int, w0: float = 2.0) -> list[float]:
    """Iterates of w <- w - eta * f'(w from tau updates ago) on f(w) = w^2 / 2 (f'(w) = w)."""
    ws = [w0]
    for t in range(steps):
        ws.append(ws[t] - eta * ws[max(0, t - tau)])
    return ws


def stale_gradient_figure(path: Path) -> Path:
    """Two panels: the seed article's picture of a stale step past the minimum, and delayed SGD on a quadratic."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.0), gridspec_kw={"width_ratios": [1.05, 1]})
    eta, w0 = 0.7, 2.0
    w1 = w0 - eta * w0  # device d0 applies the gradient it computed at w0
    w2 = w1 - eta * w0  # device d1 applies its gradient, also computed at w0: stale
    fresh = w1 - eta * w1  # what a gradient computed at w1 would have done

    def f(w: float) -> float:
        return 0.5 * w * w

    xs = [-1.6 + i * 0.02 for i in range(211)]
    left.plot(xs, [f(x) for x in xs], color="black", lw=1.5)
    left.plot([0, 0], [-0.12, 0.0], color="#55A868", lw=2)
    left.text(0, -0.3, "minimum", color="#55A868", ha="center", va="center")
    left.plot([w0], [f(w0)], "o", ms=12, color="black", zorder=5)
    left.plot([w1], [f(w1)], "o", ms=12, color="#999999", mec="black", zorder=5)
    left.plot([w2], [f(w2)], "o", ms=12, color="white", mec="black", mew=1.5, zorder=5)
    left.plot([fresh], [f(fresh)], "o", ms=9, color="none", mec="#4C72B0", mew=1.5, zorder=4)
    arrow = {"arrowstyle": "-|>", "lw": 1.4, "shrinkA": 8, "shrinkB": 8}
    left.annotate("", (w1, f(w1)), (w0, f(w0)), arrowprops={**arrow, "color": "black"})
    left.annotate("", (w2, f(w2)), (w1, f(w1)),
                  arrowprops={**arrow, "color": "#C44E52", "connectionstyle": "arc3,rad=0.5"})
    left.text(1.25, 2.45, "t0: d0 and d1 both\nread w0 = 2.0", ha="center", va="center")
    left.text(1.3, 0.45, f"t1: d0 applies ∇f(w0)\n→ w1 = {w1:.1f}", ha="left", va="center")
    left.text(-0.45, 1.35, f"t2: d1 applies its stale\n∇f(w0) → w2 = {w2:.1f}:\npast the minimum",
              ha="center", va="center", color="#C44E52")
    left.annotate(f"a fresh ∇f(w1) would\nstop at {fresh:.2f}", (fresh, f(fresh)), xytext=(0.75, -0.32),
                  color="#4C72B0", fontsize=8, va="center",
                  arrowprops={"arrowstyle": "->", "color": "#4C72B0", "lw": 1, "shrinkB": 5})
    left.set_title(f"a stale gradient: f(w) = w²/2, learning rate {eta}")
    left.set_xlabel("parameter w")
    left.set_ylabel("loss f(w)")
    left.set_ylim(-0.55, 3.2)
    left.set_xlim(-1.6, 2.6)

    eta2, steps = 0.4, 30
    curves = [(0, eta2, "τ = 0 (1 worker)"), (2, eta2, "τ = 2 (3 workers)"), (4, eta2, "τ = 4 (5 workers)"),
              (4, eta2 / 4, "τ = 4, lr-scale: lr / τ")]
    for i, (tau, lr, name) in enumerate(curves):
        right.plot(range(steps + 1), delayed_gd(lr, tau, steps), marker=".", ms=4, lw=1.3,
                   ls="--" if i == 3 else "-", color=_color(i), label=name)
    right.axhline(0, color="#55A868", lw=1)
    right.set_title(f"gradients τ updates old, same learning rate {eta2}")
    right.set_xlabel("update")
    right.set_ylabel("w (minimum at 0)")
    right.set_ylim(-3.5, 3.5)
    right.legend(frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)
    right.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


# -- report.md -----------------------------------------------------------------------------------
FIGURES = ("curves", "staleness", "timeline", "scaling")
CAPTIONS = {
    "curves": "Test accuracy and loss against wall time (left) and against updates applied (right).",
    "staleness": "Staleness of every push (shard version now minus the version the gradient was computed from), "
                 "the seeds of each setting pooled.",
    "timeline": "What each worker did over a short window: compute, the push/pull round trip, and time held "
                "back by the consistency model. Hatched: a gradient the shard dropped as late.",
    "scaling": "Throughput, staleness, idle share and final quality of each run.",
}


def make_report(path: Path, figures_dir: Path | None = None, prefix: str = "", window_s: float = 2.0,
                gantt_runs: int = 4, only: Sequence[str] = FIGURES) -> Path:
    """Draw the figures (all, or those named in `only`) for the run or sweep at `path` and write
    path/report.md embedding them."""
    unknown = sorted(set(only) - set(FIGURES))
    if unknown:
        raise ExperimentError(f"unknown figures {unknown}; valid: {', '.join(FIGURES)}")
    runs = discover_runs(path)
    figures_dir = figures_dir or path / "figures"
    plotters = {
        "curves": lambda p: plot_curves(runs, p),
        "staleness": lambda p: plot_staleness(runs, p),
        "timeline": lambda p: plot_timeline(runs, p, window_s, gantt_runs),
        "scaling": lambda p: plot_scaling(runs, p),
    }
    made: dict[str, Path | None] = {name: plotters[name](figures_dir / f"{prefix}{name}.png")
                                    for name in FIGURES if name in only}
    lines = [f"# Report: {path.name or path}\n",
             f"{len(runs)} run(s): " + ", ".join(f"`{r.path.name}` ({r.label})" for r in runs) + ".\n",
             markdown_table([(r.label, r.metrics, False) for r in runs], None)]
    unfinished = [r.path.name for r in runs if r.summary.stop_reason == UNFINISHED]
    if unfinished:
        lines.append(f"Unfinished (no summary.json: still running, or the chief stopped before writing it; "
                     f"numbers from the CSVs so far): {', '.join(f'`{n}`' for n in unfinished)}.\n")
    if (path / RESULTS_MD).exists():
        lines.append("The sweep's table with its target and its check: [results.md](results.md).\n")
    if (path / TUNE_CSV).exists():
        lines.append("A tuned sweep: each run's label names the value it chose on a validation split (results.md's "
                     "Tuning table has every candidate's score; every tuning run: [tune.csv](tune.csv)).\n")
    for name in FIGURES:
        figure = made.get(name)
        if figure is None:
            continue
        relative = os.path.relpath(figure, path)
        lines.append(f"## {name}\n\n![{name}]({relative})\n\n{CAPTIONS[name]}\n")
    report = path / "report.md"
    report.write_text("\n".join(lines))
    return report


def cmd_report(args: Any) -> int:
    """asyncps report DIR: figures and report.md."""
    import importlib.util

    missing = [m for m in ("matplotlib", "PIL") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"asyncps report needs {' and '.join(missing)}: pip install 'asyncps[report]'")
    only = [name.strip() for name in args.only.split(",") if name.strip()] if args.only else FIGURES
    report = make_report(Path(args.dir), Path(args.figures) if args.figures else None, args.prefix,
                         float(args.window), int(args.gantt_runs), only)
    print(f"report: {report}")
    return 0


def add_arguments(p: Any, dir_optional: bool = False) -> None:
    """The `asyncps report` arguments."""
    p.add_argument("dir", nargs="?" if dir_optional else None, default="",
                   help="a run directory or a sweep directory (asyncps experiment --out)")
    p.add_argument("--figures", default="", help="where to write the PNGs (default: DIR/figures)")
    p.add_argument("--prefix", default="", help="prefix of the PNG file names, e.g. e3_")
    p.add_argument("--window", default=2.0, type=float, help="seconds of the timeline (Gantt) window")
    p.add_argument("--gantt-runs", default=4, type=int, help="at most this many runs in the timeline figure")
    p.add_argument("--only", default="", help=f"comma-separated figures to draw (default: all of {','.join(FIGURES)})")


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m asyncps.tools.report DIR [...]` or `python -m asyncps.tools.report --stale-gradient-figure PATH`."""
    parser = argparse.ArgumentParser(prog="python -m asyncps.tools.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, dir_optional=True)
    parser.add_argument("--stale-gradient-figure", default="", metavar="PATH",
                        help="draw the stale-gradient teaching figure to PATH and exit")
    args = parser.parse_args(argv)
    if args.stale_gradient_figure:
        print(f"figure: {stale_gradient_figure(Path(args.stale_gradient_figure))}")
        return 0
    if not args.dir:
        parser.error("give a run or sweep directory, or --stale-gradient-figure PATH")
    try:
        return cmd_report(args)
    except (ExperimentError, RunDirError, ValueError) as exc:
        print(f"report: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
