"""Where a training step's time goes, per transport: the milliseconds of each stage of a worker's
step (from timeline.csv) and the CPU each role spends per step (from /proc), for the benchmark's
run (MLP 784-hidden-10, 2 shards + 2 workers, batch 64, local processes).

On a machine with fewer cores than processes the step is bound by CPU, not by waiting: the
"CPU ms per step" columns say who spends it (the workers' gradients, their exchange, the shards'
checks and applies, the chief), and "step ms" x steps/s / cores says how full the cores were.

Usage: python -m benchmarks.stages [--models small,large] [--transports grpc,tcp,shm] [--seconds 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from asyncps.config import RunConfig
from asyncps.rundir import RunDir, RunSummary, StepRow, read_rows
from asyncps.tools.local import LocalCluster
from benchmarks.asyncps_runs import TRANSPORTS, WARMUP_S, bench_run_config, run_watched

MODELS = {"small": (512, 512), "large": (2048, 2048)}
_TICK_S = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a live process (None once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK_S  # utime, stime (fields 14, 15 of stat)


@dataclass(frozen=True)
class Stages:
    """One run's per-step figures (medians over the steady steps, ms) and CPU per step by role."""

    transport: str
    model: str
    steps_per_s: float
    step_ms: float
    compute_ms: float
    exchange_ms: float  # push + pull of the new values, one round trip per shard in parallel
    wait_ms: float
    other_ms: float  # the rest of the step: next batch, telemetry, Python between stages
    cpu_ms: dict[str, float]  # role -> CPU ms per worker step (all processes of that role)
    bytes_per_step: float = 0.0  # bytes the shards moved (pushed + pulled, every transport) per worker step


def measure(hidden: tuple[int, ...], transport: str, seconds: float) -> Stages:
    """Run the benchmark's cluster once over `transport` and break its steps down."""
    run = bench_run_config(hidden, 2, 2, seconds, TRANSPORTS[transport])
    return measure_run(run, "-".join(str(h) for h in hidden))


def measure_run(run: RunConfig, label: str, warmup_s: float = WARMUP_S) -> Stages:
    """Run `asyncps local` with `run` to its end and break its steady steps down (`label` names the model)."""
    transport = run.transport
    with tempfile.TemporaryDirectory(prefix="asyncps-stages-") as tmp:
        cpu: dict[str, float] = {}
        marks: dict[str, float] = {}  # CPU at the end of the warm-up, per process
        started = time.monotonic()

        def sample(cluster: LocalCluster) -> None:
            for child in list(cluster.children):
                used = _cpu_s(child.proc.pid)
                if used is not None:
                    cpu[child.name] = used
                    if time.monotonic() - started < warmup_s + 1.0:
                        marks[child.name] = used

        run_watched(run, Path(tmp), sample, every_s=0.1)
        rows = read_rows(RunDir(Path(tmp)).timeline, StepRow)
        summary = RunSummary.load(Path(tmp))
    moved = sum(n for shard in summary.shards for way in shard.bytes_by_transport.values() for n in way.values())
    t0 = min(r.start for r in rows) + warmup_s + 1.0
    steady = [r for r in rows if r.start >= t0]
    if len(steady) < 4:
        raise RuntimeError(f"{transport}: {len(steady)} steady steps, too few to measure")
    by_worker: dict[int, list[float]] = {}
    for r in steady:
        by_worker.setdefault(r.worker, []).append(r.start)
    gaps = [b - a for starts in by_worker.values() for a, b in zip(sorted(starts), sorted(starts)[1:], strict=False)]
    span = max(r.end for r in steady) - min(r.start for r in steady)
    step = statistics.median(gaps)
    compute = statistics.median(r.compute_s for r in steady)
    exchange = statistics.median(r.push_s for r in steady)
    wait = statistics.median(r.wait_s for r in steady)
    roles: dict[str, float] = {}
    for name, used in cpu.items():
        role = name.split("-")[0]
        roles[role] = roles.get(role, 0.0) + used - marks.get(name, 0.0)
    steps = len(steady)
    return Stages(transport, label, steps / span, 1e3 * step, 1e3 * compute,
                  1e3 * exchange, 1e3 * wait, 1e3 * (step - compute - exchange - wait),
                  {role: 1e3 * s / steps for role, s in sorted(roles.items())}, moved / max(1, len(rows)))


def table(results: Sequence[Stages]) -> str:
    """The markdown table of the runs."""
    roles = sorted({role for r in results for role in r.cpu_ms})
    head = ("| transport | MLP | steps/s | step ms | gradient ms | exchange ms | wait ms | other ms | "
            + " | ".join(f"CPU ms/step {role}" for role in roles) + " |")
    lines = [head, "|" + "---|" * (8 + len(roles))]
    for r in results:
        lines.append(f"| {r.transport} | 784-{r.model}-10 | {r.steps_per_s:.1f} | {r.step_ms:.2f} | "
                     f"{r.compute_ms:.2f} | {r.exchange_ms:.2f} | {r.wait_ms:.2f} | {r.other_ms:.2f} | "
                     + " | ".join(f"{r.cpu_ms.get(role, 0.0):.2f}" for role in roles) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Measure every model over every transport and print the table."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stages", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="small,large", help="comma list of small, large")
    parser.add_argument("--transports", default=",".join(TRANSPORTS), help="comma list of " + ", ".join(TRANSPORTS))
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds of training per run")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    results = []
    for model in args.models.split(","):
        for transport in args.transports.split(","):
            result = measure(MODELS[model], transport, args.seconds)
            print(f"{transport} {model}: {result.steps_per_s:.1f} steps/s", flush=True)
            results.append(result)
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
