"""Scaling of `asyncps local` on one machine: steps/s and peak memory per process as workers or
shards are added (the small MLP, batch 64, no injected delays)."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.asyncps_runs import TRANSPORTS, Transport, bench_run_config, run_cluster


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
    transport: str = "grpc"


def scaling_point(workers: int, shards: int, seconds: float, hidden: tuple[int, ...] = (512, 512),
                  via: Transport | None = None) -> ScalingPoint:
    """Run one local cluster for `seconds` of training and measure it."""
    via = via or TRANSPORTS["grpc"]
    stats, peaks = run_cluster(bench_run_config(hidden, workers, shards, seconds, via))

    def peak(prefix: str) -> float:
        return max((v for k, v in peaks.items() if k.startswith(prefix)), default=0.0)

    return ScalingPoint(workers, shards, stats.steady_rate, peak("worker"), peak("ps"), peak("chief"),
                        stats.step_ms, stats.compute_ms, via.name)
