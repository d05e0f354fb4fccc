"""Consistency modes end to end: real local clusters, real gRPC, injected stragglers."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest

from asyncps.config import RunConfig
from asyncps.rundir import RunDir
from asyncps.tools.local import LocalCluster
from tests.conftest import kill_worker_mid_run
from tests.test_local_cluster import run_cli

pytestmark = pytest.mark.slow


def run_summary(tmp_path: Path, name: str, *flags: str) -> dict[str, Any]:
    run_dir = tmp_path / name
    result = run_cli(["local", "--run-dir", str(run_dir), "--eval-every-s", "30", "--quiet", *flags])
    assert result.returncode == 0, result.stdout + result.stderr
    summary: dict[str, Any] = json.loads(RunDir(run_dir).summary.read_text())
    summary["run_dir"] = run_dir
    return summary


def test_sync_applies_only_fresh_gradients(tmp_path: Path) -> None:
    s = run_summary(tmp_path, "sync", "--mode", "sync", "--max-updates", "60")
    with open(RunDir(s["run_dir"]).pushes) as f:
        applied = [r for r in csv.DictReader(f) if r["accepted"] == "1"]
    assert applied and all(r["staleness"] == "0" for r in applied)
    assert s["updates_applied"] >= 60


def test_backup_worker_beats_a_straggler(tmp_path: Path) -> None:
    flags = ["--mode", "sync", "--num-workers", "3", "--num-ps", "1", "--stragglers", "0:4x",
             "--compute-delay", "const:0.02", "--max-training-s", "8"]
    plain = run_summary(tmp_path, "sync", *flags)
    backup = run_summary(tmp_path, "backup", *flags, "--backup-workers", "1")
    ratio = backup["throughput_updates_per_s"] / plain["throughput_updates_per_s"]
    assert ratio >= 1.4, (plain["throughput_updates_per_s"], backup["throughput_updates_per_s"])
    assert backup["dropped_by_reason"].get("late", 0) > 0  # the straggler's gradients arrive late


@pytest.mark.parametrize("bound", [0, 1, 3])
def test_ssp_clock_lead_stays_within_the_bound(tmp_path: Path, bound: int) -> None:
    s = run_summary(tmp_path, f"ssp{bound}", "--mode", "ssp", "--staleness-bound", str(bound),
                    "--num-workers", "3", "--stragglers", "0:3x", "--compute-delay", "const:0.01",
                    "--max-updates", "150")
    assert s["max_clock_lead"] <= bound
    assert s["updates_applied"] >= 150


def test_drop_policy_never_applies_staler_gradients(tmp_path: Path) -> None:
    s = run_summary(tmp_path, "drop", "--staleness-policy", "drop:1", "--num-workers", "4", "--num-ps", "1",
                    "--compute-delay", "uniform:0,0.02", "--max-updates", "200")
    with open(RunDir(s["run_dir"]).pushes) as f:
        rows = list(csv.DictReader(f))
    assert all(int(r["staleness"]) <= 1 for r in rows if r["accepted"] == "1")
    dropped = [r for r in rows if r["accepted"] == "0"]
    assert dropped and all(int(r["staleness"]) > 1 for r in dropped)
    assert s["updates_dropped"] > 0


def test_killing_a_worker_in_sync_mode_does_not_stall_training(tmp_path: Path) -> None:
    run = RunConfig(mode="sync", num_workers=3, num_ps=1, epochs=0.0, max_updates=150,
                    compute_delay="const:0.01", heartbeat_timeout_s=2.0, eval_every_s=30.0)
    cluster = LocalCluster(run, tmp_path / "run")
    (tmp_path / "run").mkdir()
    try:
        at_kill = kill_worker_mid_run(cluster, lambda status: status.updates >= 30).updates
        cluster.chief.proc.wait(timeout=120)  # finishes the run: the quorum shrank
    finally:
        cluster.stop()
    summary = json.loads(RunDir(tmp_path / "run").summary.read_text())
    assert summary["updates_applied"] >= 150 > at_kill
    assert cluster.exit_codes()["chief"] == 0
