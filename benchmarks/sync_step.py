"""Per-step cost of sync decided once for all shards (asyncps.rules.sync).

One worker, two real shard processes over gRPC: the median time of a push-pull step in `async`
mode (both shards in parallel, one round trip) and in `sync` (followers, then shard 0, then the
followers again). The difference is what deciding each step once costs. Prints medians:

    python -m benchmarks.sync_step [--steps 300] [--floats 1000,1000000]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from asyncps.placement import VariableSpec, place
from asyncps.procenv import cli_command
from asyncps.rules import OptimizerConfig, UpdateRuleConfig
from asyncps.rundir import wait_port_file
from asyncps.transport import connect_model
from benchmarks.load import _shard_env

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def two_shards() -> Iterator[list[str]]:
    """Shards 0 and 1 on 127.0.0.1 (ephemeral ports); stopped on exit."""
    with tempfile.TemporaryDirectory(prefix="asyncps-sync-step-") as tmp:
        procs, addresses = [], []
        try:
            for index in (0, 1):
                port_file = Path(tmp) / f"ps{index}.port"
                procs.append(subprocess.Popen(
                    [*cli_command(), "ps", "--host", "127.0.0.1", "--port", "0",
                     "--index", str(index), "--port-file", str(port_file), "--log-level", "WARNING"],
                    cwd=ROOT, env=_shard_env()))
            for proc, index in zip(procs, (0, 1), strict=True):
                port = wait_port_file(Path(tmp) / f"ps{index}.port", 60, lambda p=proc: p.poll() is None)
                addresses.append(f"127.0.0.1:{port}")
            yield addresses
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=20)


def median_step_ms(mode: str, floats: int, steps: int) -> float:
    """The median push-pull step of one worker over two fresh shards, in milliseconds."""
    specs = [VariableSpec("a", (floats,), "float32"), VariableSpec("b", (floats,), "float32")]
    placement = place(specs, 2, slice_threshold_bytes=1 << 40)
    rule = UpdateRuleConfig(OptimizerConfig("sgd", 0.001), mode=mode, num_workers=1)
    with two_shards() as addresses:
        client = connect_model("w0", addresses, placement, transport="grpc")
        try:
            values = {s.name: np.zeros(s.shape, np.float32) for s in specs}
            for index, part in enumerate(client.split(values)):
                dense = {name: value for name, value in part.items() if isinstance(value, np.ndarray)}
                client.shards[index].initialize("bench", index, 2, rule, dense)
            client.coordinated = rule.consistency().coordinated
            client.pull()
            grads = {s.name: np.full(s.shape, 0.5, np.float32) for s in specs}
            times = []
            for step in range(steps):
                start = time.perf_counter()
                client.push_pull(grads, step, 0.0, read_wait_s=5.0)
                times.append(time.perf_counter() - start)
            assert client.versions == [steps, steps], client.versions  # every step applied on both shards
        finally:
            client.close()
    return 1000 * statistics.median(times[steps // 10:])  # the first tenth warms up


def main(argv: Sequence[str] | None = None) -> int:
    """Measure and print the medians."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--floats", default="1000,1000000", help="floats per variable (two variables, one a shard)")
    args = parser.parse_args(argv)
    print("| floats per shard | async step, ms | sync step, ms | sync decided once costs, ms |")
    print("|---|---|---|---|")
    for floats in (int(f) for f in args.floats.split(",")):
        plain = median_step_ms("async", floats, args.steps)
        decided = median_step_ms("sync", floats, args.steps)
        print(f"| {floats} | {plain:.2f} | {decided:.2f} | {decided - plain:+.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
