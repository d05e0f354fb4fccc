"""The asyncps half of the benchmarks: local clusters over one transport, shard transfer MB/s.

A transport is one entry of TRANSPORTS: its name and the RunConfig fields that select it (today
RunConfig.transport, `--transport`: gRPC frames or shared memory). Every section of `make bench`
measures each transport it is given as one more contender; a new transport is one more entry.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import subprocess
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from asyncps.config import RunConfig
from asyncps.procenv import cli_command
from asyncps.rundir import RunDir, RunSummary, StepRow, read_rows, wait_port_file
from asyncps.tools.local import LocalCluster, child_env
from benchmarks.baselines import Samples, compute_threads

ROOT = Path(__file__).resolve().parent.parent
#: Seconds of a run's training left out of its rates: connections, tf.function tracing.
WARMUP_S = 2.0


@dataclass(frozen=True)
class Transport:
    """How the workers of a run reach the shards."""

    name: str  # also the `transport` argument of asyncps.transport.connect_shard (shard_transfer)
    run_overrides: Mapping[str, Any] = field(default_factory=dict)  # RunConfig fields that select it


#: Every transport the benchmarks know, by name; `--transports` picks from these. Each is pinned
#: (not "auto"), so a contender measures the path it is named after or fails.
TRANSPORTS: dict[str, Transport] = {
    "grpc": Transport("grpc", {"transport": "grpc"}),  # tensors in gRPC frames
    "shm": Transport("shm", {"transport": "shm"}),  # tensors in shared memory, control over gRPC
    "tcp": Transport("tcp", {"transport": "tcp"}),  # tensors over a TCP data connection, control over gRPC
}


def transport(name: str) -> Transport:
    """The registered transport `name`, or a ValueError naming the known ones."""
    try:
        return TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r}; known: {', '.join(TRANSPORTS)}") from None


def bench_run_config(hidden: tuple[int, ...], workers: int, shards: int, seconds: float,
                     via: Transport, batch: int = 64, tf_threads: int | None = None) -> RunConfig:
    """The benchmark run: MLP 784-hidden-10 on synthetic data, SGD, stop after `seconds` of training.

    `tf_threads` defaults to benchmarks.baselines.compute_threads(workers), the thread rule every
    contender follows.
    """
    run = RunConfig(model="mlp:" + ",".join(str(h) for h in hidden), dataset="synthetic:784x10",
                    batch_size=batch, learning_rate=0.01, num_workers=workers, num_ps=shards, epochs=0.0,
                    max_training_s=seconds, eval_every_s=3600.0,
                    tf_threads=compute_threads(workers) if tf_threads is None else tf_threads)
    known = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = set(via.run_overrides) - known
    if unknown:
        raise ValueError(f"transport {via.name!r} sets RunConfig fields it does not have: {sorted(unknown)}")
    return dataclasses.replace(run, **dict(via.run_overrides))


@dataclass(frozen=True)
class TimelineStats:
    """What one run's timeline.csv says about its speed."""

    window_rates: list[float]  # aggregate steps/s of consecutive windows after the warm-up
    steady_rate: float  # aggregate steps/s over the whole run after the warm-up
    step_ms: float  # median wall time from one step's start to the next one's, per worker
    compute_ms: float  # median time a step spent computing gradients
    steps: int


def timeline_stats(timeline: Path, skip_s: float = WARMUP_S, window_s: float = 3.0) -> TimelineStats:
    """Rates and median step/gradient times from a run's timeline.csv (rows: one worker step)."""
    rows = read_rows(timeline, StepRow)
    if len(rows) < 2:
        raise RuntimeError(f"{timeline}: {len(rows)} steps recorded, too few to measure")
    ends = sorted(r.end for r in rows)
    t0, t_end = ends[0] + skip_s, ends[-1]
    steady = [t for t in ends if t >= t0]
    rate = (len(steady) - 1) / (steady[-1] - steady[0]) if len(steady) > 1 and steady[-1] > steady[0] else 0.0
    windows = []
    start = t0
    while start + window_s <= t_end:
        windows.append(sum(1 for t in ends if start <= t < start + window_s) / window_s)
        start += window_s
    # a step's wall time includes fetching its batch and reporting: the gap between step starts
    starts: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        starts[r.worker].append(r.start)
    gaps = [b - a for s in starts.values() for a, b in zip(sorted(s), sorted(s)[1:], strict=False)]
    step_s = statistics.median(gaps) if gaps else statistics.median(r.compute_s + r.push_s + r.wait_s for r in rows)
    compute_s = statistics.median(r.compute_s for r in rows)
    return TimelineStats(windows, rate, 1000 * step_s, 1000 * compute_s, len(rows))


def _peak_rss_mb(pid: int) -> float:
    """VmHWM (peak resident set) of a live process, in MB; 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


def run_cluster(run: RunConfig, window_s: float = 3.0) -> tuple[TimelineStats, dict[str, float]]:
    """Run `asyncps local` with `run` to its end; its timeline stats and each process' peak RSS (MB)."""
    done = run_cluster_summary(run, window_s)
    return done.stats, done.peaks


@dataclass(frozen=True)
class ClusterRun:
    """What one benchmark cluster run measured: its timeline, each process' peak RSS (MB), its summary.json."""

    stats: TimelineStats
    peaks: dict[str, float]
    summary: RunSummary


def run_watched(run: RunConfig, run_dir: Path, sample: Callable[[LocalCluster], None],
                every_s: float, replicas: int = 1) -> LocalCluster:
    """Run `asyncps local` with `run` in `run_dir` to the chief's exit, calling `sample` every `every_s` meanwhile
    (`replicas` 2: a backup per shard, as `--replicas 2`).

    The one loop the benchmarks watch a cluster with (peak RSS, CPU per role); returns the stopped cluster.
    """
    # every process exec'd (no fork server), as the baselines' are: peak RSS and CPU per process compare like for like
    cluster = LocalCluster(run, run_dir, fork=False, replicas=replicas)
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            sample(cluster)
            done.wait(every_s)

    watcher = threading.Thread(target=watch, daemon=True)
    try:
        cluster.start()
        watcher.start()
        while cluster.chief.alive():
            time.sleep(0.2)
    finally:
        done.set()
        cluster.stop()
    watcher.join(timeout=5.0)
    return cluster


def run_cluster_summary(run: RunConfig, window_s: float = 3.0, skip_s: float = WARMUP_S,
                        replicas: int = 1) -> ClusterRun:
    """run_cluster, with the run's summary (the shards' byte counts) and `skip_s` of warm-up left out of the rates
    (`replicas` 2: every shard with a backup)."""
    with tempfile.TemporaryDirectory(prefix="asyncps-bench-") as tmp:
        run_dir = Path(tmp) / "run"
        run_dir.mkdir(parents=True)
        peaks: dict[str, float] = {}

        def sample(cluster: LocalCluster) -> None:
            for child in list(cluster.children):
                peaks[child.name] = max(peaks.get(child.name, 0.0), _peak_rss_mb(child.proc.pid))

        cluster = run_watched(run, run_dir, sample, every_s=0.25, replicas=replicas)
        codes = cluster.exit_codes()
        if codes.get("chief") != 0:
            log = RunDir(run_dir).log("chief").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"asyncps chief exited with {codes.get('chief')}; chief log tail:\n{log}")
        return ClusterRun(timeline_stats(RunDir(run_dir).timeline, skip_s, window_s), peaks,
                          RunSummary.load(run_dir))


@dataclass(frozen=True)
class TrainingResult:
    """One contender's training speed on one model."""

    samples: Samples  # aggregate steps/s, one value per repetition or time window
    threads: dict[str, int]  # TF threads of its gradient-computing processes
    step_ms: float | None = None  # median wall time of one worker step, where measured
    compute_ms: float | None = None  # median gradient time of one step, where measured


def asyncps_training(hidden: tuple[int, ...], via: Transport | None = None, batch: int = 64, num_ps: int = 2,
                     num_workers: int = 2, seconds: float = 20.0, window_s: float = 3.0) -> TrainingResult:
    """Steps/s (all workers together) of `asyncps local` on an MLP 784-hidden-10, per time window."""
    via = via or TRANSPORTS["grpc"]
    run = bench_run_config(hidden, num_workers, num_ps, seconds, via, batch)
    stats, _ = run_cluster(run, window_s)
    name = f"asyncps-{via.name} {num_ps}ps+{num_workers}w {run.model}"
    return TrainingResult(Samples(name, "steps/s", stats.window_rates or [stats.steady_rate]),
                          {"intra_op": run.tf_threads, "inter_op": run.tf_threads},
                          stats.step_ms, stats.compute_ms)


def shard_transfer(megabytes: int = 40, repeats: int = 5, via: Transport | None = None) -> tuple[Samples, Samples]:
    """Pull and push MB/s between one client and one shard process holding a `megabytes` variable.

    The client is asyncps.transport.connect_shard's for `via`, as a worker's would be.
    """
    from asyncps.rules import OptimizerConfig, UpdateRuleConfig
    from asyncps.transport import connect_shard
    from asyncps.wire.shard import PushRequest

    via = via or TRANSPORTS["grpc"]
    value = np.random.default_rng(0).standard_normal(megabytes * 1_000_000 // 4).astype(np.float32)
    grad = np.full_like(value, 1e-3)
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "ps.port"
        proc = subprocess.Popen([*cli_command(), "ps", "--host", "127.0.0.1", "--port", "0",
                                 "--port-file", str(port_file), "--log-level", "WARNING"],
                                cwd=ROOT, env=child_env())
        try:
            port = wait_port_file(port_file, 60, lambda: proc.poll() is None)
            client = connect_shard(f"127.0.0.1:{port}", transport=via.name)
            client.initialize("bench", 0, 1, UpdateRuleConfig(OptimizerConfig("sgd", 1e-3)), {"w": value})
            buffers = {"w": np.empty_like(value)}
            pulls, pushes = [], []
            for i in range(repeats + 1):
                t = time.perf_counter()
                client.pull("bench", -1, buffers)
                pull_s = time.perf_counter() - t
                t = time.perf_counter()
                client.push(PushRequest("bench", i, {"w": grad}))
                push_s = time.perf_counter() - t
                if i:  # the first round trip warms channels and allocator pools
                    pulls.append(value.nbytes / 1e6 / pull_s)
                    pushes.append(value.nbytes / 1e6 / push_s)
            client.close()
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    return (Samples(f"asyncps-{via.name} pull {megabytes} MB", "MB/s", pulls),
            Samples(f"asyncps-{via.name} push {megabytes} MB", "MB/s", pushes))


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    for s in (*shard_transfer(), asyncps_training((512, 512), seconds=12).samples):
        print(s.name, s.unit, s.values)
