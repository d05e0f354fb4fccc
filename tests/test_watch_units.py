"""The pieces of watching a run, without a cluster: the summary of a run without summary.json, the
Prometheus exposition of the chief's metrics, percent/ETA formatting, `asyncps --version`."""

from __future__ import annotations

import math
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from asyncps.chief.metrics import RunCollector, RunMetrics

from asyncps.config import RunConfig
from asyncps.pb import coordinator_pb2 as cpb
from asyncps.rundir import (
    EVAL_CSV,
    PUSHES_CSV,
    TIMELINE_CSV,
    UNFINISHED,
    EvalRow,
    PushRow,
    RowWriter,
    RunConfigRecord,
    RunDirError,
    StepRow,
    load_summary,
    summary_from_tables,
)
from asyncps.tools.cli import require_module
from asyncps.tools.progress import eta_s, format_duration, status_line


def write_partial_run(run_dir: Path) -> None:
    """A run directory as a chief leaves it when killed: config.json and the CSVs, no summary.json."""
    run_dir.mkdir()
    RunConfigRecord.of(RunConfig(num_ps=2, num_workers=2, mode="async"), ["a:1", "b:2"], run_dir).save(run_dir)
    t0 = 1_000.0
    with RowWriter(run_dir / PUSHES_CSV, PushRow) as w:
        for step in range(4):  # worker 0: staleness 0, 1, 0, 1 on both shards; the last one dropped on shard 1
            for shard in (0, 1):
                accepted = not (step == 3 and shard == 1)
                w.write(PushRow(t0 + step, 0, shard, step, step, step + 1, step % 2, accepted,
                                "" if accepted else "stale", 0.1, 1.0 / (step + 1)))
    with RowWriter(run_dir / TIMELINE_CSV, StepRow) as w:
        w.write(StepRow(0, 0, t0, 0.0, 0.3, 0.1, 0.0, 32))
        w.write(StepRow(1, 0, t0, 0.0, 0.2, 0.1, 0.2, 32))
    with RowWriter(run_dir / EVAL_CSV, EvalRow) as w:
        w.write(EvalRow(t0 + 1, 1.0, 2, (2, 2), 0.9, 0.6))
        w.write(EvalRow(t0 + 2, 2.0, 3, (3, 3), 0.5, 0.8))
    with open(run_dir / PUSHES_CSV, "a") as f:
        f.write("1004.0,0,0,4,4")  # a torn last line: the chief died mid-write


def test_summary_of_a_run_without_summary_json(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_partial_run(run_dir)
    s = load_summary(run_dir)
    assert s == summary_from_tables(run_dir)
    assert s.stop_reason == UNFINISHED and not s.interrupted
    assert s.updates_applied == round((4 + 3) / 2) and s.updates_dropped == round(1 / 2)
    assert [(c.version, c.accepted, c.dropped) for c in s.shards] == [(4, 4, 0), (4, 3, 1)]
    assert s.staleness.histogram == {0: 4, 1: 4} and s.staleness.mean == 0.5
    assert s.dropped_by_reason == {"stale": 1}
    assert (s.final_eval.loss, s.final_eval.accuracy) == (0.5, 0.8)
    assert s.wall_s == 3.0 and s.throughput_updates_per_s == pytest.approx(4 / 3)
    assert s.idle_fraction == {0: 0.0, 1: pytest.approx(0.2 / 0.5)}
    assert (s.mode, s.workers, s.ps_shards) == ("async", 2, 2) and math.isnan(s.epochs)


def test_an_empty_directory_is_no_run(tmp_path: Path) -> None:
    with pytest.raises(RunDirError, match="not a run directory"):
        load_summary(tmp_path)


def _status(**fields: float) -> cpb.ClusterStatus:
    return cpb.ClusterStatus(updates=120, updates_per_s=40.0, workers_alive=2, workers_planned=2,
                             eval_loss=math.nan, eval_accuracy=math.nan, worker_loss=0.5, **fields)


def test_percent_and_eta() -> None:
    assert eta_s(10.0, 0.25) == 30.0 and eta_s(10.0, 1.0) == 0.0
    assert math.isnan(eta_s(10.0, -1.0)) and math.isnan(eta_s(0.0, 0.5)) and math.isnan(eta_s(5.0, 0.0))
    assert [format_duration(x) for x in (42.4, 185, 3725, math.nan)] == ["42s", "3m05s", "1h02m", "-"]
    line = status_line(_status(elapsed_s=10.0, fraction_done=0.25))
    assert " 25.0% ETA    30s  updates    120 (  40.0/s)" in line and "workers 2/2" in line
    unbounded = status_line(_status(elapsed_s=10.0, fraction_done=-1.0))
    assert "    -% ETA      -" not in unbounded and "] " + "    -" + " ETA      -" in unbounded


def test_metrics_exposition_parses_with_prometheus_client() -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    metrics = RunMetrics(updates=57, updates_per_s=12.5, dropped_by_reason={"stale": 3, "late": 1},
                         staleness={0: 5, 1: 3, 5: 2}, live_workers=3, planned_workers=4, eval_loss=0.25,
                         eval_accuracy=0.9, epochs=1.5, fraction_done=0.4)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RunCollector(lambda: metrics))  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("asyncps_updates_total", ())] == 57
    assert samples[("asyncps_dropped_pushes_total", (("reason", "stale"),))] == 3
    assert samples[("asyncps_dropped_pushes_total", (("reason", "late"),))] == 1
    buckets = {dict(labels)["le"]: v for (name, labels), v in samples.items() if name == "asyncps_staleness_bucket"}
    assert (buckets["0"], buckets["1"], buckets["4"], buckets["6"], buckets["+Inf"]) == (5, 8, 8, 10, 10)
    assert samples[("asyncps_staleness_count", ())] == 10 and samples[("asyncps_staleness_sum", ())] == 13
    assert samples[("asyncps_live_workers", ())] == 3 and samples[("asyncps_eval_accuracy", ())] == 0.9
    assert samples[("asyncps_fraction_done", ())] == 0.4


def test_version_flag() -> None:
    result = subprocess.run([sys.executable, "-m", "asyncps.tools.cli", "--version"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == f"asyncps {version('asyncps')}"


def test_a_missing_optional_dependency_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match=r"asyncps worker needs no_such_module_x, which is not installed: pip"):
        require_module("no_such_module_x", "asyncps worker", "pip install it")
