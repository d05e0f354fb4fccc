"""Capacity on paper: how many shards a cluster of N workers needs for a model of M parameters at 10 and
100 Gbit/s, and where the chief becomes the bottleneck, from costs measured here in the same run.

Measured (local processes, tcp data path, 2 shards + 2 workers unless said):
1. each model's shard CPU per worker step and bytes moved per step: the dense MLPs 784-512-512-10 (0.67 M
   parameters) and 784-2048-2048-10 (5.8 M), and the recsys model (one table of 1 M rows x 32, 8 ids a
   example, batch 256: only the batch's rows move). The dense costs are fitted as a + b * MB (a line
   through the two MLPs): the shard CPU a step costs for a model of any size.
2. the chief's CPU per second with lambda logical workers in 4 processes (logistic regression, the steps
   paced by an injected compute delay): lambda = 16 and 64 stepping about once a second (uniform 0.5-1.5 s)
   and lambda = 64 stepping about every 4 s (uniform 3-5 s), fitted as c0 + cw * lambda + cu * updates/s
   (a cost per live worker: heartbeats every 0.5 s, membership; and a cost per update: task requests,
   telemetry, progress), then checked against a measured lambda = 256 run at ~1 step/s (predicted
   against measured).

The table: for N workers each making R steps/s (`--steps-per-s`), shards needed = the larger of
  network: N * R * bytes per step / (link bytes/s per shard, each direction: half of bytes per step), and
  CPU: N * R * shard CPU s per step (one core per shard: a shard applies under the GIL),
and the chief's limit: the lambda at which c0 + lambda * (cw + cu * R) reaches one core.
This is a projection from one machine: the network term assumes links as fast as named, no incast loss
and no other traffic; the CPU term assumes shards on cores as fast as this machine's.

Usage: python -m benchmarks.capacity [--seconds 15] [--steps-per-s 10] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from asyncps.config import RunConfig
from asyncps.rundir import RunSummary
from asyncps.tools.local import LocalCluster
from benchmarks.asyncps_runs import TRANSPORTS, bench_run_config, run_watched
from benchmarks.sparse import recsys_run_config
from benchmarks.stages import Stages, _cpu_s, measure_run

#: The dense models measured: label -> (hidden sizes, parameters).
DENSE = {"784-512-512-10": ((512, 512), 784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10),
         "784-2048-2048-10": ((2048, 2048), 784 * 2048 + 2048 + 2048 * 2048 + 2048 + 2048 * 10 + 10)}
RECSYS_ROWS = 1_000_000
#: Cluster shapes of the table: workers, and models (label, parameters, bytes per step or None for dense).
WORKERS = (16, 64, 256, 1024)
LINKS_GBIT = (10, 100)


@dataclass(frozen=True)
class ChiefPoint:
    """The chief's CPU with `workers` logical workers: CPU seconds per second of training, updates/s."""

    workers: int
    cpu_per_s: float
    updates_per_s: float


FAST, SLOW = "uniform:0.5,1.5", "uniform:3,5"


def chief_load(workers: int, seconds: float, delay: str = FAST, processes: int = 4) -> ChiefPoint:
    """Run `workers` logical workers (logreg, steps paced by `delay`) for `seconds`; the chief's CPU rate."""
    run = RunConfig(model="logreg", dataset="synthetic-logreg", num_ps=1, num_workers=workers,
                    worker_processes=min(processes, workers), compute_delay=delay, epochs=0.0,
                    max_training_s=seconds, eval_every_s=3600.0, heartbeat_timeout_s=60.0, tf_threads=1,
                    checkpoint_every_s=0.0)
    with tempfile.TemporaryDirectory(prefix="asyncps-capacity-") as tmp:
        samples: list[tuple[float, float]] = []  # (monotonic time, chief CPU s) while training

        def sample(cluster: LocalCluster) -> None:
            used = _cpu_s(cluster.chief.proc.pid)
            if used is not None:
                samples.append((time.monotonic(), used))

        run_watched(run, Path(tmp), sample, every_s=0.5)
        summary = RunSummary.load(Path(tmp))
    # the steady part: the middle half of the chief's life (start-up imports and the final evaluation left out)
    span = samples[len(samples) // 4: 3 * len(samples) // 4 + 1]
    if len(span) < 2 or span[-1][0] <= span[0][0]:
        raise RuntimeError(f"lambda={workers}: too few samples of the chief's CPU ({len(samples)})")
    rate = (span[-1][1] - span[0][1]) / (span[-1][0] - span[0][0])
    return ChiefPoint(workers, rate, summary.throughput_updates_per_s)


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys over xs (two or more points)."""
    slope, intercept = np.polyfit(np.asarray(xs, dtype=float), np.asarray(ys, dtype=float), 1)
    return float(intercept), float(slope)


def shards_needed(workers: int, rate: float, bytes_per_step: float, cpu_s_per_step: float,
                  link_gbit: float) -> tuple[int, str]:
    """Shards for `workers` at `rate` steps/s each, and which term binds ("net" or "cpu")."""
    per_direction = workers * rate * bytes_per_step / 2  # pushes in, values out: half the bytes each way
    net = per_direction / (link_gbit * 1e9 / 8)
    cpu = workers * rate * cpu_s_per_step
    need = max(1, math.ceil(max(net, cpu)))
    return need, "net" if net >= cpu else "cpu"


def main(argv: Sequence[str] | None = None) -> int:
    """Measure the costs, print them and the table."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.capacity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="seconds of training per measured run")
    parser.add_argument("--steps-per-s", type=float, default=10.0, help="each worker's steps/s in the table")
    parser.add_argument("--quick", action="store_true", help="lambda 4 and 8 and a check at 16 (a smoke run)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    rate = args.steps_per_s

    dense: list[tuple[int, Stages]] = []
    for label, (hidden, params) in DENSE.items():
        s = measure_run(bench_run_config(hidden, 2, 2, args.seconds, TRANSPORTS["tcp"]), label)
        print(f"{label}: {s.steps_per_s:.1f} steps/s, shard CPU {s.cpu_ms.get('ps', 0.0):.2f} ms/step, "
              f"{s.bytes_per_step / 1e6:.2f} MB/step", flush=True)
        dense.append((params, s))
    recsys_run = dataclasses.replace(recsys_run_config(RECSYS_ROWS, TRANSPORTS["tcp"], args.seconds + 10.0),
                                     tf_threads=1)
    sparse = measure_run(recsys_run, f"recsys {RECSYS_ROWS} rows", warmup_s=8.0)
    print(f"recsys: {sparse.steps_per_s:.1f} steps/s, shard CPU {sparse.cpu_ms.get('ps', 0.0):.2f} ms/step, "
          f"{sparse.bytes_per_step / 1e6:.3f} MB/step", flush=True)
    # shard CPU s per step and bytes per step, as lines in the model's megabytes (4 bytes a parameter)
    mbs = [4 * p / 1e6 for p, _ in dense]
    cpu_a, cpu_b = fit_line(mbs, [s.cpu_ms.get("ps", 0.0) / 1e3 for _, s in dense])
    byte_ratio = sum(s.bytes_per_step for _, s in dense) / sum(4 * p for p, _ in dense)

    small, big, check_at = (4, 8, 16) if args.quick else (16, 64, 256)
    shapes = ((small, FAST), (big, FAST), (big, SLOW), (check_at, FAST))
    points = [chief_load(n, args.seconds + 10.0, delay) for n, delay in shapes]
    for p, (_, delay) in zip(points, shapes, strict=True):
        print(f"chief, lambda={p.workers} ({delay}): {100 * p.cpu_per_s:.1f}% of a core, "
              f"{p.updates_per_s:.1f} updates/s", flush=True)
    fitted = np.linalg.lstsq(np.array([[1.0, p.workers, p.updates_per_s] for p in points[:-1]]),
                             np.array([p.cpu_per_s for p in points[:-1]]), rcond=None)[0]
    c0, cw, cu = (float(v) for v in fitted)
    check = points[-1]
    predicted = c0 + cw * check.workers + cu * check.updates_per_s
    per_worker = cw + cu * rate
    chief_limit = (1.0 - c0) / per_worker if per_worker > 0 else math.inf

    print()
    print("Costs measured (tcp; 2 shards + 2 workers; this machine):")
    print()
    print("| model | parameters | steps/s | bytes per step | shard CPU ms per step |")
    print("|---|---|---|---|---|")
    for params, s in dense:
        print(f"| MLP {s.model} | {params / 1e6:.2f} M | {s.steps_per_s:.1f} | {s.bytes_per_step / 1e6:.2f} MB | "
              f"{s.cpu_ms.get('ps', 0.0):.2f} |")
    print(f"| recsys, {RECSYS_ROWS // 1_000_000} M x 32 table | {RECSYS_ROWS * 32 / 1e6:.0f} M | "
          f"{sparse.steps_per_s:.1f} | {sparse.bytes_per_step / 1e3:.1f} KB | {sparse.cpu_ms.get('ps', 0.0):.2f} |")
    print()
    print(f"Dense fit: shard CPU per step = {1e3 * cpu_a:.2f} ms + {1e3 * cpu_b:.2f} ms per MB of model; "
          f"bytes per step = {byte_ratio:.2f} x the model's bytes.")
    print()
    print(f"Chief: CPU s per second = {c0:.3f} + {cw * 1e3:.3f} ms x lambda + {cu * 1e3:.3f} ms x updates/s "
          f"(fitted at lambda = {small}, {big}); at lambda = {check.workers} ({check.updates_per_s:.0f} updates/s) "
          f"predicted {100 * predicted:.1f}% of a core, measured {100 * check.cpu_per_s:.1f}%.")
    print()
    models: list[tuple[str, float, float]] = []  # label, bytes per step, shard CPU s per step
    for size in (10e6, 100e6, 1e9):
        models.append((f"dense {size / 1e6:.0f} M", byte_ratio * 4 * size, cpu_a + cpu_b * 4 * size / 1e6))
    models.append((f"sparse, rows as recsys ({sparse.bytes_per_step / 1e3:.0f} KB/step)", sparse.bytes_per_step,
                   sparse.cpu_ms.get("ps", 0.0) / 1e3))
    print(f"Shards needed, each worker at {rate:g} steps/s: the larger of the network's and the CPU's need "
          "(each shown):")
    print()
    print("| model | link | " + " | ".join(f"N = {n}" for n in WORKERS) + " |")
    print("|---|---|" + "---|" * len(WORKERS))
    for label, nbytes, cpu_s in models:
        for g in LINKS_GBIT:
            cells = []
            for n in WORKERS:
                need, _ = shards_needed(n, rate, nbytes, cpu_s, g)
                net = n * rate * nbytes / 2 / (g * 1e9 / 8)
                cells.append(f"**{need}** (net {net:.1f}, cpu {n * rate * cpu_s:.1f})")
            print(f"| {label} | {g} Gbit/s | " + " | ".join(cells) + " |")
    print()
    print("The chief's checkpoint cut reads every shard's values and slots through its one link (Adam: 3 tensors "
          "a parameter):")
    print()
    print("| model | bytes per cut (SGD / Adam) | " + " | ".join(f"Adam cut at {g} Gbit/s" for g in LINKS_GBIT) + " |")
    print("|---|---|" + "---|" * len(LINKS_GBIT))
    for size in (10e6, 100e6, 1e9):
        sgd, adam = 4 * size, 12 * size
        print(f"| dense {size / 1e6:.0f} M | {sgd / 1e9:.2f} / {adam / 1e9:.2f} GB | "
              + " | ".join(f"{adam / (g * 1e9 / 8):.1f} s" for g in LINKS_GBIT) + " |")
    print()
    print(f"The chief reaches one core at lambda = {chief_limit:.0f} workers stepping {rate:g} times a second "
          f"({chief_limit * rate:.0f} worker steps/s).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
