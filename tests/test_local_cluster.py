"""End to end: `asyncps local` as real processes (shards, chief, workers) over real gRPC."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncps.rundir import RunDir
from tests.conftest import asyncps_processes

ROOT = Path(__file__).resolve().parent.parent
SUMMARY_KEYS = {"updates_applied", "updates_dropped", "staleness", "throughput_updates_per_s",
                "final_eval", "wall_s", "mode", "workers", "ps_shards"}


def run_cli(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, "-m", "asyncps.tools.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def cluster_processes(run_dir: Path) -> list[str]:
    """Command lines of live processes that belong to the run (they all name its dir or chief)."""
    chief_port = RunDir(run_dir).port_file("chief").read_text().strip()
    marks = (str(run_dir), f"127.0.0.1:{chief_port}")
    found = []
    for _pid, args in asyncps_processes():
        cmdline = " ".join(args)
        if any(m in cmdline for m in marks):
            found.append(cmdline)
    return found


def test_default_cluster_trains_and_leaves_a_complete_run_dir(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_cli(["local", "--run-dir", str(run_dir), "--epochs", "15", "--quiet"])
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(RunDir(run_dir).summary.read_text())
    assert set(summary) >= SUMMARY_KEYS
    assert {"mean", "p50", "p95", "max", "histogram"} <= set(summary["staleness"])
    assert summary["final_eval"]["accuracy"] >= 0.90
    assert summary["mode"] == "async" and summary["workers"] == 2 and summary["ps_shards"] == 2
    assert summary["updates_applied"] > 0 and summary["throughput_updates_per_s"] > 0
    assert (summary["outcome"], summary["nonfinite_steps"]) == ("finished", 0) and "verdict" not in summary
    files = RunDir(run_dir)
    for path in (files.config, files.pushes, files.evals, files.timeline):
        assert path.stat().st_size > 0, path.name
    assert any(RunDir(run_dir).tensorboard.iterdir()), "no TensorBoard event files"
    assert {p.name for p in RunDir(run_dir).logs.glob("*.log")} == {
        "ps-0.log", "ps-1.log", "chief.log", "worker-0.log", "worker-1.log"}
    pushes = RunDir(run_dir).pushes.read_text().splitlines()
    assert pushes[0].split(",")[:3] == ["wall_time", "worker", "shard"]
    # one row per (step, shard): every applied update is recorded on both shards
    assert len(pushes) - 1 >= 2 * summary["updates_applied"] * 0.95
    assert cluster_processes(run_dir) == []


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2, 4])
def test_mean_staleness_is_workers_minus_one(tmp_path: Path, workers: int) -> None:
    # Identical workers whose step time is dominated by (injected) compute take turns, so each
    # gradient sees the other lambda-1 workers' updates land in between: staleness ~ lambda-1.
    run_dir = tmp_path / f"run{workers}"
    result = run_cli(["local", "--run-dir", str(run_dir), "--num-workers", str(workers), "--num-ps", "1",
                      "--max-updates", str(60 * workers), "--compute-delay", "const:0.03",
                      "--eval-every-s", "30", "--quiet",
                      *(["--exec-roles"] if workers == 2 else [])])  # and each role exec'd, not forked: the same
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(RunDir(run_dir).summary.read_text())
    mean = summary["staleness"]["mean"]
    expected = workers - 1
    assert abs(mean - expected) <= 0.1 * expected + 0.2, summary["staleness"]


def test_bad_flag_is_one_clear_line() -> None:
    result = run_cli(["local", "--staleness-policy", "bogus", "--quiet"])
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "bogus" in result.stderr


def test_a_malformed_stop_at_is_one_clear_line() -> None:
    result = run_cli(["local", "--stop-at", "accuracy>0.9", "--quiet"])
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "METRIC>=VALUE" in result.stderr and "'accuracy>0.9'" in result.stderr


@pytest.mark.slow  # about 20 s: four processes start TensorFlow
def test_stop_at_ends_the_run_at_the_first_evaluation_that_meets_the_level(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_cli(["local", "--run-dir", str(run_dir), "--num-ps", "1", "--max-updates", "20000",
                      "--stop-at", "accuracy>=0.85", "--eval-every-s", "0.3", "--quiet"])
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(RunDir(run_dir).summary.read_text())
    assert summary["stop_reason"].startswith("reached accuracy >= 0.85 (evaluation at "), summary["stop_reason"]
    assert summary["updates_applied"] < 20000
    with open(RunDir(run_dir).evals) as f:
        accuracies = [float(row["accuracy"]) for row in csv.DictReader(f)]
    first = next(i for i, a in enumerate(accuracies) if a >= 0.85)
    # the run stopped at that evaluation: at most the final evaluation follows it
    assert first >= len(accuracies) - 2, accuracies
    assert all(a < 0.85 for a in accuracies[:first])
