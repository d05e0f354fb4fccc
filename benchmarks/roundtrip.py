"""Per-round-trip cost of asyncps's own data paths: one push-pull of N bytes of gradient in, the
shard's SGD apply, N bytes of values back, between one client and one shard process.

The same measurement as shared/limits/pingpong.py, over asyncps.transport.connect_shard (a
worker's client) instead of bare sockets. The transports take turns in blocks within one run,
so the ratios compare numbers taken at the same time.

Usage: python -m benchmarks.roundtrip [--megabytes 1.34,11.65] [--rounds 200] [--transports grpc,tcp]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from asyncps.procenv import cli_command
from asyncps.rundir import wait_port_file
from asyncps.tools.local import child_env

ROOT = Path(__file__).resolve().parent.parent


def round_trips(address: str, transport: str, megabytes: float, rounds: int, run: int) -> list[float]:
    """Milliseconds of each of `rounds` push-pulls over `transport` (after 5 warm-up ones)."""
    from asyncps.rules import OptimizerConfig, UpdateRuleConfig
    from asyncps.transport import connect_shard
    from asyncps.wire.shard import PushRequest

    count = int(megabytes * 1e6) // 4
    value = np.random.default_rng(0).standard_normal(count).astype(np.float32)
    grad = np.full_like(value, 1e-6)
    client = connect_shard(address, transport=transport)
    worker = f"w{run}"
    if run == 1:
        client.initialize(worker, 0, 1, UpdateRuleConfig(OptimizerConfig("sgd", 1e-3)), {"v": value})
    buffers = {"v": np.empty_like(value)}
    version = client.pull(worker, buffers=buffers).version
    times = []
    try:
        for i in range(rounds + 5):
            start = time.perf_counter()
            _, values = client.push_pull(PushRequest(worker, version, {"v": grad}), buffers=buffers)
            elapsed = (time.perf_counter() - start) * 1e3
            version = values.version
            if i >= 5:
                times.append(elapsed)
    finally:
        client.close()
    return times


def main(argv: list[str] | None = None) -> int:
    """Print median round trip ms per transport and size, and the same-run ratios."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", default="1.34,11.65", help="comma list of sizes each way")
    parser.add_argument("--rounds", type=int, default=200, help="round trips per block")
    parser.add_argument("--blocks", type=int, default=3, help="blocks per transport, taken in turn")
    parser.add_argument("--transports", default="grpc,tcp")
    args = parser.parse_args(argv)
    transports = args.transports.split(",")
    run = 0
    for megabytes in (float(m) for m in args.megabytes.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            port_file = Path(tmp) / "ps.port"
            proc = subprocess.Popen([*cli_command(), "ps", "--host", "127.0.0.1",
                                     "--port", "0", "--port-file", str(port_file), "--log-level", "WARNING",
                                     "--chief-timeout-s", "0"], cwd=ROOT, env=child_env())
            try:
                address = f"127.0.0.1:{wait_port_file(port_file, 60, lambda p=proc: p.poll() is None)}"
                times: dict[str, list[float]] = {t: [] for t in transports}
                for _block in range(args.blocks):
                    for name in transports:
                        run += 1
                        times[name] += round_trips(address, name, megabytes, args.rounds, run)
                run = 0
            finally:
                proc.terminate()
                proc.wait()
        medians = {name: statistics.median(t) for name, t in times.items()}
        for name, t in times.items():
            q = statistics.quantiles(t, n=10)
            print(f"{megabytes:6.2f} MB each way  {name:5s} median {medians[name]:7.2f} ms  "
                  f"p10 {q[0]:7.2f}  p90 {q[-1]:7.2f}  ({len(t)} round trips)")
        for name in transports[1:]:
            print(f"{megabytes:6.2f} MB  {transports[0]} / {name} = {medians[transports[0]] / medians[name]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
