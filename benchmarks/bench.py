"""`make bench`: asyncps against a plain Keras loop, TF's ParameterServerStrategy and raw gRPC.

Everything runs in one invocation so the ratios compare measurements taken on the same machine
at the same time. Prints medians, min-max and ratios; writes bench-results/bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.asyncps_runs import asyncps_training, shard_transfer
from benchmarks.baselines import (
    Samples,
    keras_local_loop,
    malloc_is_tuned,
    raw_grpc_streaming,
    reexec_with_tuned_malloc,
    tf_ps_strategy,
)

MODELS: tuple[tuple[int, ...], ...] = ((512, 512), (2048, 2048))


def _record(results: dict[str, Any], s: Samples) -> Samples:
    print("  " + s.summary(), flush=True)
    results["samples"][s.name] = {"unit": s.unit, "median": s.median, "min": s.min, "max": s.max,
                                  "values": s.values}
    return s


def _ratio(results: dict[str, Any], name: str, a: Samples, b: Samples) -> None:
    value = a.median / b.median
    results["ratios"][name] = value
    print(f"  ratio {name}: {value:.2f}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run every benchmark and print/write the results."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="bench-results/bench.json", help="JSON results file")
    parser.add_argument("--quick", action="store_true", help="fewer, shorter repetitions")
    args = parser.parse_args(argv)
    if not malloc_is_tuned():
        reexec_with_tuned_malloc()  # the tunables only take effect at process start
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    reps, secs = (2, 2.0) if args.quick else (5, 3.0)
    results: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                           "python": sys.version.split()[0]},
                               "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "samples": {}, "ratios": {}}
    for hidden in MODELS:
        label = "784-" + "-".join(map(str, hidden)) + "-10"
        print(f"MLP {label}, batch 64, 2 shards + 2 workers", flush=True)
        local = _record(results, keras_local_loop(hidden, repeats=reps, seconds=secs))
        tf_ps = _record(results, tf_ps_strategy(hidden, repeats=max(2, reps - 2), seconds=secs + 2))
        ours = _record(results, asyncps_training(hidden, seconds=25.0 if not args.quick else 12.0).samples)
        _ratio(results, f"asyncps/local {label}", ours, local)
        _ratio(results, f"asyncps/tf_ps_strategy {label}", ours, tf_ps)
        _ratio(results, f"tf_ps_strategy/local {label}", tf_ps, local)
    print("transfer of a 40 MB model, 1 MiB chunks", flush=True)
    raw_down, raw_up = (_record(results, s) for s in raw_grpc_streaming(40, repeats=reps))
    pull, push = (_record(results, s) for s in shard_transfer(40, repeats=reps))
    _ratio(results, "asyncps pull / raw gRPC download", pull, raw_down)
    _ratio(results, "asyncps push / raw gRPC upload", push, raw_up)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
