"""Scaling of `asyncps local` on one machine: steps/s and peak memory per process as workers or
shards are added (the small MLP, batch 64, no injected delays)."""

from __future__ import annotations

import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from asyncps.config import RunConfig
from asyncps.rundir import TIMELINE_CSV, StepRow, read_rows
from asyncps.tools.local import LocalCluster


@dataclass(frozen=True)
class ScalingPoint:
    """One cluster shape: its aggregate steps/s and the peak resident memory of each role."""

    workers: int
    shards: int
    steps_per_s: float
    worker_rss_mb: float  # largest peak RSS over the worker processes
    shard_rss_mb: float
    chief_rss_mb: float
    step_ms: float  # median wall time of one worker step
    compute_ms: float  # median gradient time of one worker step


def _peak_rss_mb(pid: int) -> float:
    """VmHWM (peak resident set) of a live process, in MB; 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


def _steady_rate(timeline: Path, skip_s: float) -> tuple[float, float, float]:
    """(steps/s after the warm-up, median step ms, median compute ms) from timeline.csv."""
    rows = read_rows(timeline, StepRow)
    ends = sorted(r.end for r in rows)
    if len(ends) < 2:
        return 0.0, 0.0, 0.0
    t0 = ends[0] + skip_s
    steady = [t for t in ends if t >= t0]
    rate = (len(steady) - 1) / (steady[-1] - steady[0]) if len(steady) > 1 and steady[-1] > steady[0] else 0.0
    steps = sorted(1000 * (r.compute_s + r.push_s + r.wait_s) for r in rows)
    compute = sorted(1000 * r.compute_s for r in rows)
    return rate, steps[len(steps) // 2], compute[len(compute) // 2]


def scaling_point(workers: int, shards: int, seconds: float, hidden: tuple[int, ...] = (512, 512)) -> ScalingPoint:
    """Run one local cluster for `seconds` of training and measure it."""
    model = "mlp:" + ",".join(str(h) for h in hidden)
    with tempfile.TemporaryDirectory(prefix="asyncps-scaling-") as tmp:
        run_dir = Path(tmp) / "run"
        run_dir.mkdir(parents=True)
        run = RunConfig(model=model, dataset="synthetic:784x10", batch_size=64, learning_rate=0.01,
                        num_workers=workers, num_ps=shards, epochs=0.0, max_seconds=seconds, eval_every_s=3600.0)
        cluster = LocalCluster(run, run_dir)
        peaks: dict[str, float] = {}
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                for child in list(cluster.children):
                    peaks[child.name] = max(peaks.get(child.name, 0.0), _peak_rss_mb(child.proc.pid))
                done.wait(0.25)

        watcher = threading.Thread(target=watch, daemon=True)
        try:
            cluster.start()
            watcher.start()
            while cluster.chief.alive():
                time.sleep(0.2)
        finally:
            done.set()
            cluster.stop()
        rate, step_ms, compute_ms = _steady_rate(run_dir / TIMELINE_CSV, skip_s=2.0)

    def peak(prefix: str) -> float:
        return max((v for k, v in peaks.items() if k.startswith(prefix)), default=0.0)

    return ScalingPoint(workers, shards, rate, peak("worker"), peak("ps"), peak("chief"), step_ms, compute_ms)
