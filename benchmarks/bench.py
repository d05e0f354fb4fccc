"""`make bench`: asyncps against a plain Keras loop, TF's ParameterServerStrategy and raw gRPC.

Everything runs in one invocation, so every ratio compares measurements taken on the same machine
at the same time. Five sections (`--only` picks some):

training  steps/s of every contender on the 784-512-512-10 and 784-2048-2048-10 MLPs (batch 64,
          2 shards + 2 workers where distributed): the local Keras loop, TF's
          ParameterServerStrategy and asyncps once per transport (`--transports`, from
          benchmarks.asyncps_runs.TRANSPORTS: gRPC frames and shared memory), with same-run
          ratios to the two baselines and the per-step overhead of each transport: median step
          time - median gradient time.
transfer  pull and push MB/s of a 40 MB model between one client and one shard, per transport,
          against raw gRPC streaming of the same bytes.
scaling   the small MLP: steps/s, step/gradient times and peak RSS per role for 1, 2, 4, 8 workers
          on 2 shards and for 1, 2, 4 shards with 2 workers (benchmarks.scaling.scaling_point).
sparse    the recsys model (one shared id table) at 10K, 1M and 10M rows (`--sparse-rows`), batch 256,
          Adagrad: the Keras loop, TF's ParameterServerStrategy with the table partitioned over 2 shards, asyncps
          over tcp and shm (2 shards x 2 workers): steps/s, bytes per step, peak RSS per role and same-run ratios
          (benchmarks.sparse).
replication  what `--replicas 2` costs: steps/s with a backup per shard against none, back to back, over tcp
          (2 shards x 2 workers), for each MLP of the training section and the recsys model at 10K rows
          (benchmarks.replication).

Every contender follows the same rules: each of `repeats` samples covers `seconds` of measured
time after a warm-up; every child process gets asyncps.procenv's allocator settings and the
thread counts of benchmarks.baselines.compute_threads (the cores shared out over the processes
that compute gradients). Prints medians, min-max and ratios as markdown tables; writes the results
as JSON (--out, default benchmarks/results/bench.json) and a plot next to it (same name, .png).
`--quick` is a smoke run of a few minutes: the small MLP only, 2 samples of 2 s, 3 scaling points
over the first transport only, the sparse section at 10K and 1M rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncps.procenv import MALLOC_ENV, has_malloc_env
from benchmarks.asyncps_runs import (
    TRANSPORTS,
    WARMUP_S,
    TrainingResult,
    asyncps_training,
    shard_transfer,
    transport,
)
from benchmarks.baselines import (
    DEFAULT_LOCAL_INTER_OP,
    Samples,
    compute_threads,
    keras_local_loop,
    raw_grpc_streaming,
    raw_tcp,
    reexec_with_tuned_malloc,
    tf_ps_strategy,
)
from benchmarks.replication import check_replication, replication_point, replication_table, workloads
from benchmarks.scaling import ScalingPoint, scaling_point
from benchmarks.sparse import (
    CACHED_TCP,
    KEYED_TCP,
    SPARSE_WARMUP_S,
    SparseResult,
    asyncps_recsys,
    check_sparse,
    keras_recsys,
    plot_sparse,
    result_json,
    sparse_ratios,
    sparse_table,
    tf_ps_recsys,
)

SCHEMA = 1
SECTIONS = ("training", "transfer", "scaling", "sparse", "replication")
#: the sparse section's table sizes, and the asyncps transports it runs
SPARSE_ROWS = (10_000, 1_000_000, 10_000_000)
SPARSE_TRANSPORTS = ("tcp", "shm")
MODELS: dict[str, tuple[int, ...]] = {"small": (512, 512), "large": (2048, 2048)}
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench.json"


@dataclass(frozen=True)
class BenchConfig:
    """What one `make bench` run measures, and for how long."""

    sections: tuple[str, ...] = SECTIONS
    models: tuple[tuple[int, ...], ...] = (MODELS["small"], MODELS["large"])
    transports: tuple[str, ...] = tuple(TRANSPORTS)
    repeats: int = 5  # samples per contender
    seconds: float = 3.0  # measured time per sample
    num_ps: int = 2  # cluster shape of the distributed training contenders
    num_workers: int = 2
    megabytes: int = 40
    scaling_hidden: tuple[int, ...] = MODELS["small"]
    scaling_workers: tuple[int, ...] = (1, 2, 4, 8)  # on fixed_shards shards
    scaling_shards: tuple[int, ...] = (1, 2, 4)  # with fixed_workers workers
    fixed_shards: int = 2
    fixed_workers: int = 2
    scaling_all_transports: bool = True  # False: the scaling section runs over transports[0] only
    sparse_rows: tuple[int, ...] = SPARSE_ROWS  # table sizes of the sparse section

    def __post_init__(self) -> None:
        unknown = set(self.sections) - set(SECTIONS)
        if unknown or not self.sections:
            raise ValueError(f"sections must be some of {', '.join(SECTIONS)}, got {list(self.sections)}")
        for name in self.transports:
            transport(name)
        if not self.transports:
            raise ValueError("name at least one transport")
        if self.repeats < 1 or self.seconds <= 0 or self.megabytes < 1:
            raise ValueError("repeats and megabytes must be >= 1 and seconds > 0")
        if min((*self.scaling_workers, *self.scaling_shards, self.fixed_shards, self.fixed_workers)) < 1:
            raise ValueError("worker and shard counts must be >= 1")
        if "sparse" in self.sections and (not self.sparse_rows or min(self.sparse_rows) < 2):
            raise ValueError("sparse rows must be >= 2 (name at least one size)")

    @property
    def train_seconds(self) -> float:
        """Training time of one asyncps run: the warm-up, then `repeats` windows of `seconds`."""
        return WARMUP_S + self.repeats * self.seconds + 0.5

    def scaling_points(self) -> list[tuple[int, int]]:
        """(workers, shards) of every scaling point, each shape once."""
        points = [(w, self.fixed_shards) for w in self.scaling_workers]
        points += [(self.fixed_workers, s) for s in self.scaling_shards]
        return list(dict.fromkeys(points))


QUICK = dict(models=(MODELS["small"],), repeats=2, seconds=2.0, scaling_workers=(1, 2), scaling_shards=(1,),
             scaling_all_transports=False, sparse_rows=SPARSE_ROWS[:2])


def model_label(hidden: Sequence[int]) -> str:
    """784-512-512-10 for hidden (512, 512)."""
    return "-".join(str(n) for n in (784, *hidden, 10))


# -- contenders ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Contender:
    """One way to train the benchmark MLP; `reference` ones get a ratio column in the tables."""

    name: str
    measure: Callable[[tuple[int, ...], BenchConfig], TrainingResult]
    reference: bool = False
    transport: str | None = None  # asyncps contenders: the transport they run over


def _keras(hidden: tuple[int, ...], cfg: BenchConfig) -> TrainingResult:
    samples = keras_local_loop(hidden, repeats=cfg.repeats, seconds=cfg.seconds)
    # one process, nothing to wait for: its step is all computation and update
    return TrainingResult(samples, {"intra_op": compute_threads(1), "inter_op": DEFAULT_LOCAL_INTER_OP},
                          step_ms=1000.0 / samples.median)


def _tf_ps(hidden: tuple[int, ...], cfg: BenchConfig) -> TrainingResult:
    samples = tf_ps_strategy(hidden, num_ps=cfg.num_ps, num_workers=cfg.num_workers, repeats=cfg.repeats,
                             seconds=cfg.seconds)
    return TrainingResult(samples, {"intra_op": compute_threads(cfg.num_workers), "inter_op": cfg.num_workers + 1})


def _asyncps(name: str, hidden: tuple[int, ...], cfg: BenchConfig) -> TrainingResult:
    return asyncps_training(hidden, transport(name), num_ps=cfg.num_ps, num_workers=cfg.num_workers,
                            seconds=cfg.train_seconds, window_s=cfg.seconds)


def training_contenders(cfg: BenchConfig) -> list[Contender]:
    """The baselines, then asyncps once per transport: a new transport is one more entry."""
    return [
        Contender("keras-local", _keras, reference=True),
        Contender("tf-ps-strategy", _tf_ps, reference=True),
        *(Contender(f"asyncps-{t}", functools.partial(_asyncps, t), transport=t) for t in cfg.transports),
    ]


@dataclass(frozen=True)
class TransferContender:
    """One way to move the model between a client and a server: (pull MB/s, push MB/s)."""

    name: str
    measure: Callable[[BenchConfig], tuple[Samples, Samples]]
    reference: bool = False


def transfer_contenders(cfg: BenchConfig) -> list[TransferContender]:
    """Raw gRPC streaming and a raw TCP socket (download = pull, upload = push), then asyncps once
    per transport."""
    return [
        TransferContender("raw-grpc", lambda c: raw_grpc_streaming(c.megabytes, repeats=c.repeats), reference=True),
        TransferContender("raw-tcp", lambda c: raw_tcp(c.megabytes, repeats=c.repeats), reference=True),
        *(TransferContender(f"asyncps-{t}", functools.partial(
            lambda name, c: shard_transfer(c.megabytes, c.repeats, transport(name)), t)) for t in cfg.transports),
    ]


# -- running -------------------------------------------------------------------------------------
def _samples_json(s: Samples) -> dict[str, Any]:
    return {"name": s.name, "unit": s.unit, "median": s.median, "min": s.min, "max": s.max, "values": s.values}


_FAILURES = (RuntimeError, TimeoutError, OSError, ValueError)


def _run_training(cfg: BenchConfig, results: dict[str, Any]) -> None:
    training: dict[str, Any] = results.setdefault("training", {})
    overhead: dict[str, Any] = results.setdefault("overhead", {})
    contenders = training_contenders(cfg)
    for hidden in cfg.models:
        label = model_label(hidden)
        print(f"## training: MLP {label}, batch 64, {cfg.num_ps} shards + {cfg.num_workers} workers", flush=True)
        entry: dict[str, Any] = {"contenders": {}, "ratios": {}}
        training[label] = entry
        for c in contenders:
            try:
                r = c.measure(hidden, cfg)
            except _FAILURES as exc:
                results["failures"][f"training {label} {c.name}"] = str(exc)[-2000:]
                print(f"  {c.name}: FAILED: {exc}", flush=True)
                continue
            over = None if r.step_ms is None or r.compute_ms is None else r.step_ms - r.compute_ms
            entry["contenders"][c.name] = {**_samples_json(r.samples), "threads": r.threads, "transport": c.transport,
                                           "reference": c.reference, "step_ms": r.step_ms,
                                           "compute_ms": r.compute_ms, "overhead_ms": over}
            print("  " + r.samples.summary(), flush=True)
            if c.transport is not None and over is not None:
                overhead.setdefault(c.transport, {})[label] = {"step_ms": r.step_ms, "compute_ms": r.compute_ms,
                                                               "overhead_ms": over}
        measured = entry["contenders"]
        for ref in (c for c in contenders if c.reference and c.name in measured):
            for other in (c for c in contenders if c.name != ref.name and c.name in measured):
                entry["ratios"][f"{other.name} / {ref.name}"] = (measured[other.name]["median"]
                                                                 / measured[ref.name]["median"])


def _run_transfer(cfg: BenchConfig, results: dict[str, Any]) -> None:
    print(f"## transfer: a {cfg.megabytes} MB model, pull and push", flush=True)
    section: dict[str, Any] = {"megabytes": cfg.megabytes, "contenders": {}, "ratios": {}}
    results["transfer"] = section
    contenders = transfer_contenders(cfg)
    for c in contenders:
        try:
            pull, push = c.measure(cfg)
        except _FAILURES as exc:
            results["failures"][f"transfer {c.name}"] = str(exc)[-2000:]
            print(f"  {c.name}: FAILED: {exc}", flush=True)
            continue
        section["contenders"][c.name] = {"pull": _samples_json(pull), "push": _samples_json(push),
                                         "reference": c.reference}
        print(f"  {pull.summary()}\n  {push.summary()}", flush=True)
    measured = section["contenders"]
    for ref in (c for c in contenders if c.reference and c.name in measured):
        for other in (c for c in contenders if c.name != ref.name and c.name in measured):
            for way in ("pull", "push"):
                section["ratios"][f"{other.name} / {ref.name} {way}"] = (measured[other.name][way]["median"]
                                                                         / measured[ref.name][way]["median"])


def _run_scaling(cfg: BenchConfig, results: dict[str, Any]) -> None:
    seconds = WARMUP_S + cfg.repeats * cfg.seconds
    section: dict[str, Any] = {"hidden": list(cfg.scaling_hidden), "model": model_label(cfg.scaling_hidden),
                               "seconds": seconds, "fixed_shards": cfg.fixed_shards,
                               "fixed_workers": cfg.fixed_workers, "points": []}
    results["scaling"] = section
    for name in cfg.transports if cfg.scaling_all_transports else cfg.transports[:1]:
        print(f"## scaling: MLP {section['model']} over {name}", flush=True)
        for workers, shards in cfg.scaling_points():
            try:
                p = scaling_point(workers, shards, seconds, cfg.scaling_hidden, transport(name))
            except _FAILURES as exc:
                results["failures"][f"scaling {name} {workers}w {shards}ps"] = str(exc)[-2000:]
                print(f"  {workers} workers, {shards} shards: FAILED: {exc}", flush=True)
                continue
            section["points"].append(dataclasses.asdict(p))
            print(f"  {workers} workers, {shards} shards: {p.steps_per_s:.1f} steps/s, step {p.step_ms:.2f} ms, "
                  f"worker RSS {p.worker_rss_mb:.0f} MB", flush=True)


def sparse_contenders(cfg: BenchConfig) -> list[tuple[str, Callable[[int], SparseResult]]]:
    """The sparse section's contenders by name, each measuring one table size: the baselines, then asyncps over
    tcp and shm, over tcp with the workers' row cache, and over tcp with the table keyed."""
    seconds = SPARSE_WARMUP_S + cfg.repeats * cfg.seconds + 0.5
    return [
        ("keras-local", lambda rows: keras_recsys(rows, cfg.repeats, cfg.seconds)),
        ("tf-ps-strategy", lambda rows: tf_ps_recsys(rows, cfg.repeats, cfg.seconds, cfg.num_ps, cfg.num_workers)),
        *((f"asyncps-{t}", functools.partial(lambda via, rows: asyncps_recsys(
            rows, transport(via), seconds, cfg.seconds, cfg.num_ps, cfg.num_workers), t)) for t in SPARSE_TRANSPORTS),
        ("asyncps-tcp-cache", lambda rows: asyncps_recsys(rows, CACHED_TCP, seconds, cfg.seconds, cfg.num_ps,
                                                          cfg.num_workers)),
        ("asyncps-tcp-keyed", lambda rows: asyncps_recsys(rows, KEYED_TCP, seconds, cfg.seconds, cfg.num_ps,
                                                          cfg.num_workers)),
    ]


def _run_sparse(cfg: BenchConfig, results: dict[str, Any]) -> None:
    section: dict[str, Any] = {"batch": 256, "num_ps": cfg.num_ps, "num_workers": cfg.num_workers, "rows": {},
                               "ratios": {}}
    results["sparse"] = section
    for rows in cfg.sparse_rows:
        print(f"## sparse: recsys model, {rows} rows, batch 256, {cfg.num_ps} shards + {cfg.num_workers} workers",
              flush=True)
        entry: dict[str, Any] = section["rows"].setdefault(str(rows), {})
        for name, measure in sparse_contenders(cfg):
            try:
                r = measure(rows)
            except _FAILURES as exc:
                results["failures"][f"sparse {rows} {name}"] = str(exc)[-2000:]
                print(f"  {name}: FAILED: {exc}", flush=True)
                continue
            entry[name] = result_json(r)
            print(f"  {r.samples.summary()}", flush=True)
    section["ratios"] = sparse_ratios(section["rows"])


def _run_replication(cfg: BenchConfig, results: dict[str, Any]) -> None:
    section: dict[str, Any] = {"transport": "tcp", "num_ps": 2, "num_workers": 2, "workloads": {}}
    results["replication"] = section
    for label, run, skip_s in workloads(cfg.models, cfg.train_seconds):
        print(f"## replication: {label}, replicas 1 then 2, tcp, 2 shards + 2 workers", flush=True)
        try:
            entry = replication_point(run, cfg.seconds, skip_s)
        except _FAILURES as exc:
            results["failures"][f"replication {label}"] = str(exc)[-2000:]
            print(f"  FAILED: {exc}", flush=True)
            continue
        section["workloads"][label] = entry
        print(f"  replicas 1: {entry['1']['median']:.1f} steps/s, replicas 2: {entry['2']['median']:.1f} steps/s "
              f"({entry['ratio']:.2f}x)", flush=True)


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Measure every section of `cfg`; the results as a JSON-able dict (see validate)."""
    started = time.time()
    results: dict[str, Any] = {
        "schema": SCHEMA,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
                    "load_start": list(os.getloadavg())},
        "env": {"malloc": MALLOC_ENV, "malloc_in_this_process": has_malloc_env(),
                "threads": "intra_op = max(1, cores // gradient-computing processes) per such process"},
        "config": dataclasses.asdict(cfg),
        "failures": {},
    }
    runners = {"training": _run_training, "transfer": _run_transfer, "scaling": _run_scaling, "sparse": _run_sparse,
               "replication": _run_replication}
    for section in SECTIONS:
        if section in cfg.sections:
            runners[section](cfg, results)
    results["machine"]["load_end"] = list(os.getloadavg())
    results["wall_s"] = time.time() - started
    return results


# -- checking, tables, plot ----------------------------------------------------------------------
_SAMPLE_KEYS = {"name": str, "unit": str, "median": float, "min": float, "max": float, "values": list}
_POINT_KEYS = {f.name for f in dataclasses.fields(ScalingPoint)}


def _check_samples(where: str, s: Any) -> list[str]:
    if not isinstance(s, dict):
        return [f"{where}: not an object"]
    problems = [f"{where}.{k}: missing or not {t.__name__}" for k, t in _SAMPLE_KEYS.items()
                if not isinstance(s.get(k), int | float if t is float else t)]
    if not problems:
        if not s["values"] or not all(isinstance(v, int | float) and math.isfinite(v) for v in s["values"]):
            problems.append(f"{where}.values: empty or not finite numbers")
        elif not s["min"] <= s["median"] <= s["max"]:
            problems.append(f"{where}: median outside min-max")
    return problems


def validate(results: Any) -> list[str]:
    """Problems of a results dict against this module's schema; [] when it is well-formed."""
    if not isinstance(results, dict):
        return ["results: not an object"]
    problems = [f"{k}: missing" for k in ("schema", "started", "machine", "env", "config", "failures", "wall_s")
                if k not in results]
    if results.get("schema") != SCHEMA:
        problems.append(f"schema: {results.get('schema')!r}, expected {SCHEMA}")
    sections = results.get("config", {}).get("sections", [])
    for section in sections:
        if section not in results:
            problems.append(f"{section}: in config.sections but missing")
    for label, entry in results.get("training", {}).items():
        for name, c in entry.get("contenders", {}).items():
            problems += _check_samples(f"training.{label}.{name}", c)
            if not isinstance(c.get("threads"), dict):
                problems.append(f"training.{label}.{name}.threads: missing")
        for name, ratio in entry.get("ratios", {}).items():
            if not (isinstance(ratio, float) and ratio > 0):
                problems.append(f"training.{label}.ratios.{name}: not a positive number")
    for via, models in results.get("overhead", {}).items():
        for label, o in models.items():
            if not all(isinstance(o.get(k), float) for k in ("step_ms", "compute_ms", "overhead_ms")):
                problems.append(f"overhead.{via}.{label}: needs step_ms, compute_ms, overhead_ms")
    if "transfer" in results:
        t = results["transfer"]
        if not isinstance(t.get("megabytes"), int):
            problems.append("transfer.megabytes: missing")
        for name, c in t.get("contenders", {}).items():
            for way in ("pull", "push"):
                problems += _check_samples(f"transfer.{name}.{way}", c.get(way))
    if "sparse" in results:
        problems += check_sparse(results["sparse"])
        for rows, entry in results["sparse"].get("rows", {}).items():
            problems += [p for name, c in entry.items() for p in _check_samples(f"sparse.rows.{rows}.{name}", c)]
    if "replication" in results:
        problems += check_replication(results["replication"])
    if "scaling" in results:
        for i, p in enumerate(results["scaling"].get("points", [])):
            if set(p) != _POINT_KEYS:
                problems.append(f"scaling.points[{i}]: keys {sorted(p)}, expected {sorted(_POINT_KEYS)}")
    return problems


def _fmt(x: Any, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def markdown_tables(results: dict[str, Any]) -> str:
    """Every section of `results` as markdown tables."""
    out: list[str] = []
    for label, entry in results.get("training", {}).items():
        measured = entry["contenders"]
        refs = [n for n, c in measured.items() if c["reference"]]
        out += [f"### Training steps/s, MLP {label}", "",
                "| contender | steps/s median | min-max | n | threads (intra/inter) | step ms | gradient ms | "
                "overhead ms |" + "".join(f" / {r} |" for r in refs),
                "|---|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(refs)]
        for name, c in measured.items():
            ratios = "".join(f" {_fmt(c['median'] / measured[r]['median'], '.2f')} |" for r in refs)
            out.append(f"| {name} | {c['median']:.1f} | {c['min']:.1f}-{c['max']:.1f} | {len(c['values'])} | "
                       f"{c['threads'].get('intra_op')}/{c['threads'].get('inter_op')} | {_fmt(c['step_ms'], '.2f')} | "
                       f"{_fmt(c['compute_ms'], '.2f')} | {_fmt(c['overhead_ms'], '.2f')} |{ratios}")
        out.append("")
    if results.get("overhead"):
        out += ["### Per-step overhead (median step time - median gradient time) per transport", "",
                "| transport | model | step ms | gradient ms | overhead ms |", "|---|---|---:|---:|---:|"]
        for via, models in results["overhead"].items():
            for label, o in models.items():
                out.append(f"| {via} | {label} | {o['step_ms']:.2f} | {o['compute_ms']:.2f} | {o['overhead_ms']:.2f} |")
        out.append("")
    if "transfer" in results:
        t = results["transfer"]
        refs = [n for n, c in t["contenders"].items() if c["reference"]]
        out += [f"### Transfer of a {t['megabytes']} MB model, MB/s", "",
                "| contender | direction | MB/s median | min-max | n |" + "".join(f" / {r} |" for r in refs),
                "|---|---|---:|---:|---:|" + "---:|" * len(refs)]
        for name, c in t["contenders"].items():
            for way in ("pull", "push"):
                s = c[way]
                ratios = "".join(f" {s['median'] / t['contenders'][r][way]['median']:.2f} |" for r in refs)
                out.append(f"| {name} | {way} | {s['median']:.0f} | {s['min']:.0f}-{s['max']:.0f} | "
                           f"{len(s['values'])} |{ratios}")
        out.append("")
    if "scaling" in results:
        sc = results["scaling"]
        out += [f"### Scaling, MLP {sc['model']}, {sc['seconds']:.0f} s of training per point", "",
                "| transport | workers | shards | steps/s | step ms | gradient ms | peak RSS worker MB | "
                "shard MB | chief MB |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for p in sorted(sc["points"], key=lambda p: (p["transport"], p["shards"] != sc["fixed_shards"],
                                                     p["workers"], p["shards"])):
            out.append(f"| {p['transport']} | {p['workers']} | {p['shards']} | {p['steps_per_s']:.1f} | "
                       f"{p['step_ms']:.2f} | {p['compute_ms']:.2f} | {p['worker_rss_mb']:.0f} | "
                       f"{p['shard_rss_mb']:.0f} | {p['chief_rss_mb']:.0f} |")
        out.append("")
    if "sparse" in results:
        out += sparse_table(results["sparse"])
    if "replication" in results:
        out += replication_table(results["replication"])
    if results.get("failures"):
        out += ["### Failures", ""]
        out += [f"- {k}: {v.splitlines()[0] if v else ''}" for k, v in results["failures"].items()]
    return "\n".join(out)


def plot(results: dict[str, Any], path: Path) -> None:
    """Steps/s per contender (one panel per model) and the scaling curves, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: list[tuple[str, Any]] = [(f"training {label}", entry)
                                     for label, entry in results.get("training", {}).items()]
    if results.get("scaling", {}).get("points"):
        panels += [("scaling: workers", results["scaling"]), ("scaling: shards", results["scaling"]),
                   ("scaling: peak RSS", results["scaling"])]
    if "transfer" in results:
        panels.append(("transfer", results["transfer"]))
    if results.get("sparse", {}).get("rows"):
        panels.append(("sparse: recsys steps/s", results["sparse"]))
    cols = min(3, max(1, len(panels)))
    rows = max(1, math.ceil(len(panels) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_axis_off()
    for ax, (title, data) in zip(axes.flat, panels, strict=False):
        if title.startswith("sparse"):
            plot_sparse(ax, data)
        elif title.startswith("training"):
            names = list(data["contenders"])
            med = [data["contenders"][n]["median"] for n in names]
            err = [[m - data["contenders"][n]["min"] for n, m in zip(names, med, strict=True)],
                   [data["contenders"][n]["max"] - m for n, m in zip(names, med, strict=True)]]
            ax.bar(names, med, yerr=err, capsize=4, color=[f"C{i}" for i in range(len(names))])
            ax.set_ylabel("steps/s (median, min-max)")
            ax.tick_params(axis="x", rotation=20)
        elif title == "transfer":
            names = list(data["contenders"])
            for k, way in enumerate(("pull", "push")):
                ax.bar([i + 0.4 * k for i in range(len(names))],
                       [data["contenders"][n][way]["median"] for n in names], width=0.4, label=way)
            ax.set_xticks([i + 0.2 for i in range(len(names))], names)
            ax.tick_params(axis="x", rotation=20)  # five contender names side by side collide otherwise
            ax.set_ylabel("MB/s (median)")
            ax.legend()
        else:
            for via in sorted({p["transport"] for p in data["points"]}):
                pts = [p for p in data["points"] if p["transport"] == via]
                if title == "scaling: shards":
                    line = sorted((p["shards"], p["steps_per_s"]) for p in pts if p["workers"] == data["fixed_workers"])
                    if line:
                        ax.plot([x for x, _ in line], [y for _, y in line], marker="o", label=via)
                    ax.set_xlabel(f"shards ({data['fixed_workers']} workers)")
                    ax.set_ylabel("steps/s")
                else:
                    by_w = sorted((p for p in pts if p["shards"] == data["fixed_shards"]), key=lambda p: p["workers"])
                    xs = [p["workers"] for p in by_w]
                    if title == "scaling: workers":
                        ax.plot(xs, [p["steps_per_s"] for p in by_w], marker="o", label=via)
                        ax.set_ylabel("steps/s")
                    elif by_w:
                        for role in ("worker", "shard", "chief"):
                            ax.plot(xs, [p[f"{role}_rss_mb"] for p in by_w], marker="o", label=f"{via} {role}")
                        ax.set_ylabel("peak RSS MB")
                    ax.set_xlabel(f"workers ({data['fixed_shards']} shards)")
            if ax.get_legend_handles_labels()[0]:
                ax.legend()
        if title.startswith("scaling"):
            ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_title(title)
    if not panels:
        axes[0][0].text(0.5, 0.5, "no results", ha="center")
    fig.suptitle(f"asyncps bench {results.get('started', '')}, {results.get('machine', {}).get('cpus')} CPUs")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- command line --------------------------------------------------------------------------------
def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _model(text: str) -> tuple[int, ...]:
    return MODELS[text] if text in MODELS else _ints(text.replace("x", ","))


def parse_args(argv: Sequence[str] | None = None) -> tuple[BenchConfig, Path, bool]:
    """(the run's config, the JSON path, whether to re-exec with MALLOC_ENV)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file; the plot goes next to it")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: small MLP, 2 samples of 2 s, 3 scaling points on the first transport, "
                        "the sparse section at 10K and 1M rows")
    parser.add_argument("--only", action="append", choices=SECTIONS, help="run only this section (repeatable)")
    parser.add_argument("--seconds", type=float, help="measured seconds per sample (default 3, quick 2)")
    parser.add_argument("--repeats", type=int, help="samples per contender (default 5, quick 2)")
    parser.add_argument("--models", help="comma list of small, large or hidden sizes like 256x256")
    parser.add_argument("--transports", default=",".join(TRANSPORTS),
                        help=f"asyncps transports, comma list of {', '.join(TRANSPORTS)}")
    parser.add_argument("--megabytes", type=int, help="model size of the transfer section (default 40)")
    parser.add_argument("--scaling-workers", type=_ints,
                        help="worker counts on --fixed-shards shards (default 1,2,4,8; '' for none)")
    parser.add_argument("--scaling-shards", type=_ints,
                        help="shard counts with --fixed-workers workers (default 1,2,4; '' for none)")
    parser.add_argument("--fixed-shards", type=int, help="shards of the worker-scaling points (default 2)")
    parser.add_argument("--fixed-workers", type=int, help="workers of the shard-scaling points (default 2)")
    parser.add_argument("--sparse-rows", type=_ints,
                        help="table sizes of the sparse section (default 10000,1000000,10000000; quick the first two)")
    parser.add_argument("--no-reexec", action="store_true", help="do not re-execute with asyncps.procenv.MALLOC_ENV")
    args = parser.parse_args(argv)
    values: dict[str, Any] = dict(QUICK) if args.quick else {}
    values["transports"] = tuple(t for t in args.transports.split(",") if t)
    if args.only:
        values["sections"] = tuple(s for s in SECTIONS if s in args.only)
    if args.models:
        values["models"] = tuple(_model(m) for m in args.models.split(",") if m)
    for key in ("seconds", "repeats", "megabytes", "scaling_workers", "scaling_shards", "fixed_shards",
                "fixed_workers", "sparse_rows"):
        if getattr(args, key) is not None:
            values[key] = getattr(args, key)
    try:
        cfg = BenchConfig(**values)
    except ValueError as exc:
        parser.error(str(exc))
    return cfg, args.out, not args.no_reexec


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print the tables, write JSON and PNG. 1 when a measurement failed."""
    cfg, out, _ = parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    results = run_bench(cfg)
    problems = validate(results)
    if problems:  # a bug here, not a slow machine: say so, but keep what was measured
        results["failures"]["schema"] = "; ".join(problems)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    png = out.with_suffix(".png")
    plot(results, png)
    print("\n" + markdown_tables(results), flush=True)
    print(f"wrote {out} and {png} ({results['wall_s']:.0f} s)", flush=True)
    return 1 if results["failures"] else 0


def cli(argv: Sequence[str] | None = None) -> int:
    """`python -m benchmarks.bench`: re-exec with MALLOC_ENV first (glibc reads it at start)."""
    if parse_args(argv)[2]:
        reexec_with_tuned_malloc()  # returns only when already in effect
    return main(argv)


if __name__ == "__main__":
    sys.exit(cli())
