"""The bench's sparse section: the recsys model (one shared id table) at growing table sizes.

Contenders, each on asyncps' `recsys:rows=R` data and model (batch 256, Adagrad): the plain Keras loop in one
process (the table in that process), TF's ParameterServerStrategy with the table partitioned over the shards
(plain TF: benchmarks/_tf_sparse_child.py says why), and asyncps over each transport (2 shards x 2 workers,
through the cluster runner of the other asyncps contenders), asyncps over tcp with the workers' row cache
(`--row-cache-staleness 4`), and asyncps over tcp with the table keyed (`recsys:...,hashed=1` data, whose ids
are 64-bit hashes, into `recsys:keyed=1`: an asyncps.HashEmbedding keeping the same number of rows). Each
gives steps/s (all workers together, over windows after a warm-up: the chief's
set-up of a big table is left out), bytes moved per worker step (asyncps: the shards' pulled + pushed bytes of
every transport over the run's steps; TF: not measured, None) and peak RSS per role (worker, shard, chief; the
local loop is one worker); asyncps over tcp also the bytes its workers pulled per step (the chief's reads of
the model go over shared memory: left out), the distinct rows a step touched and the row cache's hit rate.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncps.config import RunConfig
from benchmarks.asyncps_runs import Transport, _peak_rss_mb, run_cluster_summary
from benchmarks.baselines import (
    _STARTUP_TIMEOUT_S,
    Samples,
    _Children,
    _free_ports,
    _tf_child_argv,
    compute_threads,
)

#: The row cache contender's S (asyncps.transport.rowcache).
CACHE_STALENESS = 4
#: asyncps over tcp with the workers' row cache: a contender of its own.
CACHED_TCP = Transport("tcp-cache", {"transport": "tcp", "row_cache_staleness": CACHE_STALENESS})
#: asyncps over tcp with the table keyed (hashed ids into a HashEmbedding): a contender of its own.
KEYED_TCP = Transport("tcp-keyed", {"transport": "tcp"})
_SPARSE_CHILD = Path(__file__).resolve().parent / "_tf_sparse_child.py"
BATCH = 256
LEARNING_RATE = 0.05
_WARMUP_STEPS = 20
#: Seconds of an asyncps run left out of its rates: connections, tracing (a big table takes longer to place).
SPARSE_WARMUP_S = 4.0
#: Seconds per million table rows added to an asyncps run's length: its first pushes take that long (10M rows:
#: ~11 s on this machine, the shards' first update of their parts), and the chief's max_training_s counts them,
#: so without it a 10M-row run ended before its first measured window.
SETUP_S_PER_MILLION_ROWS = 2.0


@dataclass(frozen=True)
class SparseResult:
    """One contender at one table size."""

    samples: Samples  # aggregate steps/s, one value per repetition or time window
    bytes_per_step: float | None  # tensor bytes pulled + pushed per worker step; None: not measurable
    rss_mb: dict[str, float]  # peak resident memory by role: worker, shard, chief (the largest of each)
    # asyncps over tcp: tensor bytes the workers pulled per step, distinct rows a step pushed, row cache hit rate
    pulled_per_step: float | None = None
    rows_per_step: float | None = None
    hit_rate: float | None = None


def _child_argv(role: str, **kwargs: object) -> list[str]:
    return [sys.executable, str(_SPARSE_CHILD), role, json.dumps(kwargs)]


def keras_recsys(rows: int, repeats: int, seconds: float) -> SparseResult:
    """The plain Keras loop in one process (its own table), steps/s per repetition."""
    intra, inter = compute_threads(1), 1
    with _Children() as children:
        child = children.start("keras-recsys", _child_argv(
            "local", rows=rows, batch=BATCH, learning_rate=LEARNING_RATE, repeats=repeats, seconds=seconds,
            warmup_steps=_WARMUP_STEPS, intra_op=intra, inter_op=inter), intra, inter)
        result = json.loads(child.read_tagged_line("RESULT", _STARTUP_TIMEOUT_S + 3 * repeats * seconds))
    return SparseResult(Samples(f"keras local loop recsys {rows} rows", "steps/s", result["values"]), None,
                        {"worker": result["rss_mb"]})


def tf_ps_recsys(rows: int, repeats: int, seconds: float, num_ps: int = 2, num_workers: int = 2) -> SparseResult:
    """TF's ParameterServerStrategy, the table in one part per PS task; aggregate steps/s per repetition."""
    ports = _free_ports(num_ps + num_workers)
    cluster = {"ps": [f"127.0.0.1:{p}" for p in ports[:num_ps]],
               "worker": [f"127.0.0.1:{p}" for p in ports[num_ps:]]}
    threads = {"ps": (1, 0), "worker": (compute_threads(num_workers), num_workers + 1), "coordinator": (1, 0)}
    tasks = [("ps", i) for i in range(num_ps)] + [("worker", i) for i in range(num_workers)]
    with _Children() as children:
        servers = [children.start(f"tf-{job}-{i}", _tf_child_argv(
            "server", cluster=cluster, job_name=job, task_index=i, intra_op=threads[job][0],
            inter_op=threads[job][1], parent_pid=os.getpid()), *threads[job]) for job, i in tasks]
        for server in servers:
            server.read_tagged_line("READY", _STARTUP_TIMEOUT_S)
        coordinator = children.start("tf-coordinator", _child_argv(
            "coordinator", cluster=cluster, rows=rows, batch=BATCH, learning_rate=LEARNING_RATE, repeats=repeats,
            seconds=seconds, warmup_steps=_WARMUP_STEPS, intra_op=1, inter_op=0), 1, 0)
        result = json.loads(coordinator.read_tagged_line("RESULT", _STARTUP_TIMEOUT_S + 4 * repeats * seconds))
        rss = {"shard": max(_peak_rss_mb(s.proc.pid) for s in servers[:num_ps]),
               "worker": max(_peak_rss_mb(s.proc.pid) for s in servers[num_ps:]), "chief": result["rss_mb"]}
    return SparseResult(Samples(f"TF ParameterServerStrategy {num_ps}ps+{num_workers}w recsys {rows} rows",
                                "steps/s", result["values"]), None, rss)


def recsys_run_config(rows: int, via: Transport, seconds: float, num_ps: int = 2, num_workers: int = 2) -> RunConfig:
    """The asyncps run of the sparse section: recsys data and model of `rows` rows, Adagrad, stop after `seconds`;
    no periodic checkpoint (the chief reads the whole model for one: 1.28 GB at 10M rows, tens of seconds on
    this machine, which the baselines never do; the final one comes after the measured steps). KEYED_TCP: the
    ids hashed and the table keyed, of as many rows."""
    keyed = via is KEYED_TCP
    run = RunConfig(model=f"recsys:rows={rows},keyed=1" if keyed else "recsys",
                    dataset=f"recsys:rows={rows}" + (",hashed=1" if keyed else ""), batch_size=BATCH,
                    optimizer="adagrad", learning_rate=LEARNING_RATE, num_workers=num_workers, num_ps=num_ps,
                    epochs=0.0, max_training_s=seconds, eval_every_s=3600.0, tf_threads=compute_threads(num_workers),
                    checkpoint_every_s=0.0)
    return dataclasses.replace(run, **dict(via.run_overrides))


def asyncps_recsys(rows: int, via: Transport, seconds: float, window_s: float, num_ps: int = 2,
                   num_workers: int = 2) -> SparseResult:
    """asyncps over `via`: aggregate steps/s per window after the warm-up (the run lengthened by its table's set-up),
    bytes per step from the shards' counts."""
    run = recsys_run_config(rows, via, seconds + rows / 1e6 * SETUP_S_PER_MILLION_ROWS, num_ps, num_workers)
    done = run_cluster_summary(run, window_s, skip_s=SPARSE_WARMUP_S)
    stats, peaks = done.stats, done.peaks
    summary, steps = done.summary, max(1, stats.steps)
    moved = sum(n for shard in summary.shards for way in shard.bytes_by_transport.values() for n in way.values())
    # the workers' pulls over tcp: the chief reads through shared memory (asyncps local's default)
    tcp = sum(shard.bytes_by_transport.get("tcp", {}).get("pulled", 0) for shard in summary.shards)

    def peak(prefix: str) -> float:
        return max((v for k, v in peaks.items() if k.startswith(prefix)), default=0.0)

    return SparseResult(Samples(f"asyncps-{via.name} {num_ps}ps+{num_workers}w recsys {rows} rows", "steps/s",
                                stats.window_rates or [stats.steady_rate]), moved / steps,
                        {"worker": peak("worker"), "shard": peak("ps"), "chief": peak("chief")},
                        tcp / steps if run.transport == "tcp" else None,
                        summary.row_staleness.rows / steps if summary.row_staleness is not None else None,
                        summary.row_cache.get("hit_rate"))


# -- the section's results: JSON entries, ratios, table, check, plot -----------------------------------------
#: (numerator, denominator, rows) of the same-run ratios; rows None: the largest measured over the smallest
RATIOS: tuple[tuple[str, str, int | None], ...] = (
    ("asyncps-tcp", "tf-ps-strategy", 1_000_000),
    ("asyncps-tcp", "keras-local", 10_000_000),
    ("asyncps-shm", "keras-local", 10_000_000),
    ("asyncps-tcp", "asyncps-tcp", None),
    ("asyncps-shm", "asyncps-shm", None),
    ("asyncps-tcp-cache", "asyncps-tcp", 1_000_000),
    ("asyncps-tcp-cache", "asyncps-tcp", 10_000_000),
    ("asyncps-tcp-keyed", "asyncps-tcp", 1_000_000),
    ("asyncps-tcp-keyed", "asyncps-tcp", 10_000_000),
)


def result_json(r: SparseResult) -> dict[str, Any]:
    """One contender's entry: its samples, bytes per step and peak RSS by role."""
    s = r.samples
    return {"name": s.name, "unit": s.unit, "median": s.median, "min": s.min, "max": s.max, "values": s.values,
            "bytes_per_step": r.bytes_per_step, "rss_mb": r.rss_mb, "pulled_per_step": r.pulled_per_step,
            "rows_per_step": r.rows_per_step, "hit_rate": r.hit_rate}


def sparse_ratios(by_rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The section's same-run ratios of median steps/s, each where both sides were measured (`by_rows`: rows ->
    contender -> entry); the scaling ones compare a contender's largest table with its smallest."""
    ratios: dict[str, float] = {}
    for top, bottom, rows in RATIOS:
        if rows is not None:
            entry = by_rows.get(str(rows), {})
            if top in entry and bottom in entry and entry[bottom]["median"] > 0:
                ratios[f"{top} / {bottom} at {rows} rows"] = entry[top]["median"] / entry[bottom]["median"]
            continue
        sizes = sorted(int(k) for k, entry in by_rows.items() if top in entry)
        if len(sizes) > 1 and by_rows[str(sizes[0])][top]["median"] > 0:
            big, small = by_rows[str(sizes[-1])][top], by_rows[str(sizes[0])][top]
            ratios[f"{top} {sizes[-1]} / {sizes[0]} rows"] = big["median"] / small["median"]
    return ratios


def _mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 1e6:.2f}"


def _num(value: float | None, scale: float, spec: str) -> str:
    return "-" if value is None else format(value * scale, spec)


def sparse_table(section: dict[str, Any]) -> list[str]:
    """The section as markdown: one row per table size and contender, then the ratios."""
    out = [f"### Sparse: recsys model (one id table, dim 32), batch {section['batch']}, Adagrad", "",
           "| rows | contender | steps/s median | min-max | n | MB moved/step | KB pulled/step | rows/step | "
           "cache hits | peak RSS worker MB | shard MB | chief MB |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for rows, entry in section["rows"].items():
        for name, c in entry.items():
            rss = c["rss_mb"]
            cells = [f"{rss[r]:.0f}" if r in rss else "-" for r in ("worker", "shard", "chief")]
            extra = [_num(c.get("pulled_per_step"), 1e-3, ".1f"), _num(c.get("rows_per_step"), 1, ".0f"),
                     _num(c.get("hit_rate"), 1, ".2f")]
            out.append(f"| {rows} | {name} | {c['median']:.1f} | {c['min']:.1f}-{c['max']:.1f} | {len(c['values'])} | "
                       f"{_mb(c['bytes_per_step'])} | {' | '.join(extra)} | {' | '.join(cells)} |")
    out += ["", "| ratio of median steps/s | value |", "|---|---:|"]
    out += [f"| {name} | {value:.3f} |" for name, value in section["ratios"].items()]
    return [*out, ""]


def check_sparse(section: Any) -> list[str]:
    """Problems of the section's JSON shape (the samples are checked like every section's by the caller)."""
    if not isinstance(section, dict) or not isinstance(section.get("rows"), dict):
        return ["sparse.rows: missing"]
    problems = []
    for rows, entry in section["rows"].items():
        for name, c in entry.items():
            if not isinstance(c.get("rss_mb"), dict) or "bytes_per_step" not in c:
                problems.append(f"sparse.rows.{rows}.{name}: needs rss_mb and bytes_per_step")
    problems += [f"sparse.ratios.{k}: not a positive number" for k, v in section.get("ratios", {}).items()
                 if not (isinstance(v, float) and v > 0)]
    return problems


def plot_sparse(ax: Any, section: dict[str, Any]) -> None:
    """Median steps/s per contender, grouped by table size, on a log scale."""
    sizes = list(section["rows"])
    names = list(dict.fromkeys(n for entry in section["rows"].values() for n in entry))
    width = 0.8 / max(1, len(names))
    for k, name in enumerate(names):
        xs = [i + k * width for i, rows in enumerate(sizes) if name in section["rows"][rows]]
        ys = [section["rows"][rows][name]["median"] for rows in sizes if name in section["rows"][rows]]
        ax.bar(xs, ys, width=width, label=name, color=f"C{k}")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sizes))], [f"{int(r):,} rows" for r in sizes])
    ax.set_yscale("log")
    ax.set_ylabel("steps/s (median, log)")
    tallest = max((c["median"] for entry in section["rows"].values() for c in entry.values()), default=1.0)
    ax.set_ylim(top=tallest * 30)  # room above the bars for the legend
    ax.legend(fontsize=7, ncol=2, loc="upper left")
