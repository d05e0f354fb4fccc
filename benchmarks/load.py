"""Load benchmark: many concurrent pushers against one shard process, with exact accounting.

`python -m benchmarks.load --pushers 32 --seconds 10` starts a shard on an ephemeral port (or uses
`--address`), initializes it with SGD at lr=1, then runs N threads, each with its own channel,
pushing known integer-valued float32 gradients for a bounded time. Integers keep float32 arithmetic
exact in any order, so the result is checked bit for bit: the shard's version must have advanced by
exactly the number of accepted pushes and its values must equal initial - sum(accepted gradients).
Prints throughput and latency percentiles; writes bench-results/load.json. Exit status 1 when the
accounting or any push failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from asyncps.procenv import cli_command, process_env
from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.rundir import wait_port_file
from asyncps.transport import GrpcShardTransport
from asyncps.wire.shard import PushRequest

ROOT = Path(__file__).resolve().parent.parent
GRADIENT_RANGE = 2  # gradient entries are integers in [-2, 2]
EXACT_LIMIT = 2**24  # float32 holds every integer up to here exactly


@dataclass(frozen=True)
class LoadConfig:
    """One load run: how many pushers, for how long, and the model they push to."""

    pushers: int = 32
    seconds: float = 10.0
    rows: int = 64  # the variable "w" is rows x cols; "b" has cols entries
    cols: int = 32
    call_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.pushers < 1 or self.seconds <= 0 or self.rows < 1 or self.cols < 1:
            raise ValueError("pushers, rows and cols must be >= 1 and seconds > 0")


def initial_values(config: LoadConfig) -> dict[str, npt.NDArray[np.float32]]:
    """Small integer starting values, so the exact expected result stays representable."""
    w = (np.arange(config.rows * config.cols) % 7 - 3).astype(np.float32).reshape(config.rows, config.cols)
    return {"w": w, "b": np.zeros(config.cols, np.float32)}


def gradient(pusher: int, step: int, config: LoadConfig) -> dict[str, npt.NDArray[np.float32]]:
    """The known gradient pusher `pusher` sends at its step `step`: integers in [-2, 2]."""
    span = 2 * GRADIENT_RANGE + 1
    w = (np.arange(config.rows * config.cols) * (pusher + 1) + step) % span - GRADIENT_RANGE
    b = (np.arange(config.cols) + 3 * pusher + 2 * step) % span - GRADIENT_RANGE
    return {"w": w.astype(np.float32).reshape(config.rows, config.cols), "b": b.astype(np.float32)}


@dataclass
class PusherRecord:
    """What one pusher did: per-push latencies, the sum of its accepted gradients, errors."""

    index: int
    latencies_s: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    accepted: int = 0
    dropped: int = 0
    errors: list[str] = field(default_factory=list)
    # int64 sums: exact whatever the number of pushes
    sums: dict[str, npt.NDArray[np.int64]] = field(default_factory=dict)


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else float("nan")


@dataclass
class LoadResult:
    """A finished run: counts, timings, and whether the shard's state is exactly as expected."""

    config: LoadConfig
    wall_s: float
    records: list[PusherRecord]
    version_before: int
    version_after: int
    stats_accepted: int
    stats_dropped: int
    mismatched: dict[str, float]  # variable -> largest absolute difference from the expectation

    @property
    def pushes(self) -> int:
        """Pushes answered (accepted or dropped)."""
        return sum(len(r.latencies_s) for r in self.records)

    @property
    def accepted(self) -> int:
        """Pushes the shard applied."""
        return sum(r.accepted for r in self.records)

    @property
    def errors(self) -> list[str]:
        """Every failed push, as 'pusher N: error'."""
        return [f"pusher {r.index}: {e}" for r in self.records for e in r.errors]

    @property
    def throughput(self) -> float:
        """Pushes answered per second of wall time, all pushers together."""
        return self.pushes / self.wall_s

    @property
    def exact(self) -> bool:
        """No errors, version advanced by exactly the accepted pushes, values exactly as expected."""
        return (not self.errors and not self.mismatched and self.version_after - self.version_before == self.accepted
                and self.stats_accepted == self.version_after)

    def latency_ms(self) -> dict[str, float]:
        """Percentiles over all pushes, and the spread over pushers (median of per-pusher medians...)."""
        every = [s * 1e3 for r in self.records for s in r.latencies_s]
        per_pusher = [[s * 1e3 for s in r.latencies_s] for r in self.records if r.latencies_s]
        medians = [statistics.median(p) for p in per_pusher]
        return {
            "p50": _percentile(every, 50), "p95": _percentile(every, 95), "p99": _percentile(every, 99),
            "max": max(every, default=float("nan")), "mean": statistics.fmean(every) if every else float("nan"),
            "median_of_pusher_medians": statistics.median(medians) if medians else float("nan"),
            "min_pusher_median": min(medians, default=float("nan")),
            "max_pusher_median": max(medians, default=float("nan")),
            "max_pusher_p99": max((_percentile(p, 99) for p in per_pusher), default=float("nan")),
        }

    def summary(self) -> dict[str, Any]:
        """Everything worth keeping, JSON-ready."""
        per_pusher = [len(r.latencies_s) for r in self.records]
        staleness = [s for r in self.records for s in r.staleness]
        return {
            "config": asdict(self.config),
            "pushes": self.pushes, "accepted": self.accepted,
            "dropped": sum(r.dropped for r in self.records), "errors": self.errors[:20],
            "error_count": len(self.errors),
            "wall_s": self.wall_s, "throughput_pushes_per_s": self.throughput,
            "latency_ms": self.latency_ms(),
            "pushes_per_pusher": {"min": min(per_pusher), "median": statistics.median(per_pusher),
                                  "max": max(per_pusher)},
            "staleness": {"mean": statistics.fmean(staleness) if staleness else 0.0,
                          "max": max(staleness, default=0)},
            "version_before": self.version_before, "version_after": self.version_after,
            "stats_pushes_accepted": self.stats_accepted, "stats_pushes_dropped": self.stats_dropped,
            "mismatched": self.mismatched, "exact": self.exact,
        }

    def report(self) -> str:
        """A few human-readable lines."""
        lat = self.latency_ms()
        lines = [
            f"{self.config.pushers} pushers x {self.config.seconds:g}s, w[{self.config.rows}x{self.config.cols}] + "
            f"b[{self.config.cols}] float32: {self.pushes} pushes ({self.accepted} accepted, "
            f"{len(self.errors)} errors) in {self.wall_s:.2f}s = {self.throughput:.0f} pushes/s",
            f"push latency ms: p50 {lat['p50']:.2f}  p95 {lat['p95']:.2f}  p99 {lat['p99']:.2f}  "
            f"max {lat['max']:.2f}  mean {lat['mean']:.2f}",
            f"per pusher: median of medians {lat['median_of_pusher_medians']:.2f} ms "
            f"(range {lat['min_pusher_median']:.2f}-{lat['max_pusher_median']:.2f}), "
            f"worst p99 {lat['max_pusher_p99']:.2f} ms",
            f"accounting: version {self.version_before} -> {self.version_after}, "
            f"{'EXACT' if self.exact else 'MISMATCH ' + json.dumps(self.mismatched)}",
        ]
        lines += [f"  {e}" for e in self.errors[:5]]
        return "\n".join(lines)


def _push_loop(
    address: str, config: LoadConfig, record: PusherRecord, start: threading.Barrier, run: dict[str, float],
) -> None:
    """One pusher: its own channel, pushes until the shared deadline, every outcome recorded."""
    client = GrpcShardTransport(address, deadline_s=config.call_timeout_s, call_timeout_s=config.call_timeout_s)
    member = f"pusher-{record.index}"
    record.sums = {name: np.zeros(v.shape, np.int64) for name, v in initial_values(config).items()}
    try:
        base_version = int(client.stats().version)  # also opens the connection before the clock starts
        start.wait()
        step = 0
        while time.perf_counter() < run["deadline"]:
            grads = gradient(record.index, step, config)
            began = time.perf_counter()
            try:
                result = client.push(PushRequest(member, base_version, grads, step=step))
            except Exception as exc:  # a load test records every failure and carries on
                record.errors.append(f"{type(exc).__name__}: {exc}")
                if len(record.errors) > 10:
                    break
                continue
            record.latencies_s.append(time.perf_counter() - began)
            record.staleness.append(int(result.staleness))
            if result.accepted:
                record.accepted += 1
                for name, g in grads.items():
                    record.sums[name] += g.astype(np.int64)
            else:
                record.dropped += 1
            base_version = int(result.version)
            step += 1
    except Exception as exc:
        record.errors.append(f"{type(exc).__name__}: {exc}")
        with contextlib.suppress(threading.BrokenBarrierError):
            start.abort()
    finally:
        client.close()


def run_load(address: str, config: LoadConfig) -> LoadResult:
    """Initialize the shard at `address` (idempotent), run the pushers, and check the accounting.

    Nothing else may push to the shard meanwhile. A shard that already holds this model (an
    identical earlier initialization) is fine: the check starts from the values it holds now.
    """
    setup = GrpcShardTransport(address, deadline_s=config.call_timeout_s, call_timeout_s=config.call_timeout_s)
    try:
        setup.initialize("load", 0, 1, UpdateRuleConfig(OptimizerConfig("sgd", 1.0)),
                         initial_values(config))
        before = setup.pull("load")
        assert before.values is not None
        records = [PusherRecord(i) for i in range(config.pushers)]
        run: dict[str, float] = {}

        def go() -> None:  # runs once, when every pusher is connected and waiting
            run["start"] = time.perf_counter()
            run["deadline"] = run["start"] + config.seconds

        start = threading.Barrier(config.pushers, action=go)
        threads = [threading.Thread(target=_push_loop, args=(address, config, r, start, run), name=f"pusher-{r.index}")
                   for r in records]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall_s = time.perf_counter() - run.get("start", time.perf_counter())
        after = setup.pull("load")
        stats = setup.stats()
    finally:
        setup.close()
    assert after.values is not None
    accepted = sum(r.accepted for r in records)
    mismatched: dict[str, float] = {}
    for name, value in before.values.items():
        # every intermediate value is an integer below this bound, so each float32 step was exact
        if np.abs(value).max(initial=0.0) + accepted * GRADIENT_RANGE >= EXACT_LIMIT:
            raise ValueError(f"{name}: values may have left float32's exact integer range; push less")
        total = np.zeros(value.shape, np.int64)
        for record in records:
            if name in record.sums:
                total += record.sums[name]
        expected = value.astype(np.int64) - total
        diff = float(np.abs(after.values[name].astype(np.float64) - expected).max(initial=0.0))
        if diff != 0 or after.values[name].dtype != np.float32:
            mismatched[name] = diff
    return LoadResult(config, max(wall_s, 1e-9), records, before.version, after.version,
                      int(stats.pushes_accepted), int(stats.pushes_dropped), mismatched)


def _shard_env() -> dict[str, str]:
    # asyncps.procenv's allocator and thread settings; flags only: ASYNCPS_* and TF_CONFIG in the
    # environment would override them
    return process_env({k: v for k, v in os.environ.items() if not k.startswith("ASYNCPS_") and k != "TF_CONFIG"},
                       intra_op=1)


@contextlib.contextmanager
def local_shard(log_level: str = "WARNING") -> Iterator[str]:
    """Start one shard process on 127.0.0.1 and an ephemeral port; yield its address; stop it."""
    with tempfile.TemporaryDirectory(prefix="asyncps-load-") as tmp:
        port_file = Path(tmp) / "ps.port"
        proc = subprocess.Popen([*cli_command(), "ps", "--host", "127.0.0.1", "--port", "0",
                                 "--port-file", str(port_file), "--log-level", log_level], cwd=ROOT, env=_shard_env())
        try:
            port = wait_port_file(port_file, 60, lambda: proc.poll() is None)
            yield f"127.0.0.1:{port}"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the load benchmark, print the results and write them as JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = LoadConfig()
    parser.add_argument("--pushers", type=int, default=defaults.pushers, help="concurrent pushers (threads)")
    parser.add_argument("--seconds", type=float, default=defaults.seconds, help="how long they push")
    parser.add_argument("--rows", type=int, default=defaults.rows, help="rows of the variable w")
    parser.add_argument("--cols", type=int, default=defaults.cols, help="columns of w, entries of b")
    parser.add_argument("--address", default="", help="an existing shard to load (default: start one)")
    parser.add_argument("--out", default="bench-results/load.json", help="JSON results file")
    args = parser.parse_args(argv)
    config = LoadConfig(pushers=args.pushers, seconds=args.seconds, rows=args.rows, cols=args.cols)
    with contextlib.ExitStack() as stack:
        address = args.address or stack.enter_context(local_shard())
        result = run_load(address, config)
    print(result.report(), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = result.summary()
    summary["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "python": sys.version.split()[0]}
    summary["started"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    summary["address"] = args.address or "local shard process"
    out.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    print(f"wrote {out}")
    return 0 if result.exact else 1


if __name__ == "__main__":
    sys.exit(main())
