"""The asyncps half of the benchmarks: training steps/s of a local cluster, shard transfer MB/s."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from asyncps.config import RunConfig
from asyncps.rundir import wait_port_file
from asyncps.tools.local import LocalCluster, child_env
from benchmarks.baselines import Samples

ROOT = Path(__file__).resolve().parent.parent


def _window_rates(timeline: Path, skip_s: float, window_s: float) -> list[float]:
    """Aggregate steps/s over consecutive windows of the run, after a warm-up."""
    with open(timeline) as f:
        ends = sorted(float(r["start"]) + float(r["compute_s"]) + float(r["push_s"]) for r in csv.DictReader(f))
    if not ends:
        return []
    t0, t_end = ends[0] + skip_s, ends[-1]
    rates = []
    start = t0
    while start + window_s <= t_end:
        n = sum(1 for t in ends if start <= t < start + window_s)
        rates.append(n / window_s)
        start += window_s
    return rates


def asyncps_training(hidden: tuple[int, ...], batch: int = 64, num_ps: int = 2, num_workers: int = 2,
                     seconds: float = 20.0, window_s: float = 3.0) -> Samples:
    """Steps/s (all workers together) of `asyncps local` on an MLP 784-hidden-10, per time window."""
    model = "mlp:" + ",".join(str(h) for h in hidden)
    with tempfile.TemporaryDirectory(prefix="asyncps-bench-") as tmp:
        run_dir = Path(tmp) / "run"
        run = RunConfig(model=model, dataset="synthetic:784x10", batch_size=batch, learning_rate=0.01,
                        num_workers=num_workers, num_ps=num_ps, epochs=0.0, max_seconds=seconds,
                        eval_every_s=3600.0)
        cluster = LocalCluster(run, run_dir)
        run_dir.mkdir(parents=True)
        try:
            cluster.start()
            while cluster.chief.alive():
                time.sleep(0.2)
        finally:
            cluster.stop()
        rates = _window_rates(run_dir / "timeline.csv", skip_s=2.0, window_s=window_s)
        with open(run_dir / "timeline.csv") as f:
            steps = list(csv.DictReader(f))
    # where a worker's step time goes: gradient computation vs the push-and-pull round trip
    for column in ("compute_s", "push_s"):
        values = sorted(float(r[column]) for r in steps)
        if values:
            print(f"    {model}: median {column} {1000 * values[len(values) // 2]:.2f} ms per step", flush=True)
    return Samples(f"asyncps {num_ps}ps+{num_workers}w {model}", "steps/s", rates)


def shard_transfer(megabytes: int = 40, repeats: int = 5) -> tuple[Samples, Samples]:
    """Pull and push MB/s between one client and one shard process holding a `megabytes` variable."""
    from asyncps.rules import OptimizerConfig, UpdateRuleConfig
    from asyncps.shard import PushRequest
    from asyncps.transport import GrpcShardTransport

    value = np.random.default_rng(0).standard_normal(megabytes * (1 << 20) // 4).astype(np.float32)
    grad = np.full_like(value, 1e-3)
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "ps.port"
        proc = subprocess.Popen([sys.executable, "-m", "asyncps.tools.cli", "ps", "--host", "127.0.0.1", "--port", "0",
                                 "--port-file", str(port_file), "--log-level", "WARNING"],
                                cwd=ROOT, env=child_env())
        try:
            port = wait_port_file(port_file, 60, lambda: proc.poll() is None)
            client = GrpcShardTransport(f"127.0.0.1:{port}")
            client.initialize("bench", 0, 1, UpdateRuleConfig(OptimizerConfig("sgd", 1e-3)),
                              {"w": value})
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
                    pulls.append(megabytes * 1.048576 / pull_s)
                    pushes.append(megabytes * 1.048576 / push_s)
            client.close()
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    return (Samples(f"asyncps pull {megabytes} MB", "MB/s", pulls),
            Samples(f"asyncps push {megabytes} MB", "MB/s", pushes))


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    for s in (*shard_transfer(), asyncps_training((512, 512), seconds=12)):
        print(s.name, s.unit, s.values)
