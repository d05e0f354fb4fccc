"""The bench's replication section: what `--replicas 2` costs (asyncps.ps.replica: every shard forwards each state
change to its backup and answers a push only once the backup applied it).

For each workload, one run with a backup per shard and one without, back to back in the same bench run, over the
tcp transport (2 shards x 2 workers): the small and the large MLP of the training section, and the sparse
section's recsys model at its smallest table. Each gives steps/s (all workers together, per window after the
warm-up) and the median step time; the ratio is replicas 2 over replicas 1. On this machine's 2 cores the backups
are two more processes sharing them: the cost measured is the forwarding's round trip and the backups' CPU
together, which separate hosts would not share.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asyncps.config import RunConfig
from benchmarks.asyncps_runs import TRANSPORTS, WARMUP_S, bench_run_config, run_cluster_summary
from benchmarks.baselines import Samples
from benchmarks.sparse import SPARSE_WARMUP_S, recsys_run_config

#: the replica counts compared, in the order they run
REPLICAS = (1, 2)
#: the sparse workload's table
SPARSE_ROWS = 10_000


def workloads(models: tuple[tuple[int, ...], ...], seconds: float) -> list[tuple[str, RunConfig, float]]:
    """(label, run, warm-up s) of each workload: an MLP per model, then the recsys model."""
    via = TRANSPORTS["tcp"]
    runs = [("mlp " + "-".join(str(n) for n in (784, *hidden, 10)), bench_run_config(hidden, 2, 2, seconds, via),
             WARMUP_S) for hidden in models]
    runs.append((f"recsys {SPARSE_ROWS} rows", recsys_run_config(SPARSE_ROWS, via, seconds + SPARSE_WARMUP_S),
                 SPARSE_WARMUP_S))
    return runs


def replication_point(run: RunConfig, window_s: float, skip_s: float,
                      measure: Callable[..., Any] = run_cluster_summary) -> dict[str, Any]:
    """One workload with each replica count: steps/s samples and median step ms per count, and the ratio."""
    entry: dict[str, Any] = {}
    for replicas in REPLICAS:
        done = measure(run, window_s, skip_s=skip_s, replicas=replicas)
        s = Samples(f"replicas {replicas}", "steps/s", done.stats.window_rates or [done.stats.steady_rate])
        entry[str(replicas)] = {"name": s.name, "unit": s.unit, "median": s.median, "min": s.min, "max": s.max,
                                "values": s.values, "step_ms": done.stats.step_ms, "steps": done.stats.steps}
    entry["ratio"] = entry["2"]["median"] / entry["1"]["median"]
    return entry


def check_replication(section: Any) -> list[str]:
    """Problems of the section's JSON; [] when well-formed."""
    if not isinstance(section, dict) or not isinstance(section.get("workloads"), dict):
        return ["replication.workloads: missing"]
    problems = []
    for label, entry in section["workloads"].items():
        for count in map(str, REPLICAS):
            c = entry.get(count)
            if not isinstance(c, dict) or not c.get("values") or not isinstance(c.get("step_ms"), float):
                problems.append(f"replication.{label}.{count}: needs values and step_ms")
        if not (isinstance(entry.get("ratio"), float) and entry["ratio"] > 0):
            problems.append(f"replication.{label}.ratio: not a positive number")
    return problems


def replication_table(section: dict[str, Any]) -> list[str]:
    """The section as a markdown table."""
    out = ["### Replication's cost: steps/s with a backup per shard (--replicas 2) against none, tcp, "
           "2 shards + 2 workers", "",
           "| workload | replicas 1 steps/s | min-max | step ms | replicas 2 steps/s | min-max | step ms | "
           "2 / 1 |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label, e in section["workloads"].items():
        one, two = e["1"], e["2"]
        out.append(f"| {label} | {one['median']:.1f} | {one['min']:.1f}-{one['max']:.1f} | {one['step_ms']:.2f} | "
                   f"{two['median']:.1f} | {two['min']:.1f}-{two['max']:.1f} | {two['step_ms']:.2f} | "
                   f"{e['ratio']:.2f} |")
    return [*out, ""]
