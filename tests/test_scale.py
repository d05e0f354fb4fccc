"""End to end, slow: the start barrier and logical workers as real local clusters."""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path

import pytest

from asyncps.config import RunConfig
from asyncps.rundir import RunDir
from asyncps.tools.local import LocalCluster, worker_groups
from tests.conftest import kill_worker_mid_run
from tests.test_local_cluster import run_cli


def test_worker_groups_split_indices_into_contiguous_blocks() -> None:
    assert worker_groups(3, 0) == [("worker-0", 0, 1), ("worker-1", 1, 1), ("worker-2", 2, 1)]
    assert worker_groups(7, 3) == [("workers-0", 0, 3), ("workers-1", 3, 2), ("workers-2", 5, 2)]
    assert worker_groups(2, 2) == [("worker-0", 0, 1), ("worker-1", 1, 1)]


def local_run(run_dir: Path, *flags: str) -> dict[str, object]:
    result = run_cli(["local", "--run-dir", str(run_dir), "--quiet", *flags], timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    summary: dict[str, object] = json.loads(RunDir(run_dir).summary.read_text())
    return summary


@pytest.mark.slow
def test_with_the_barrier_eight_workers_are_seven_updates_stale(tmp_path: Path) -> None:
    """No injected delay: 8 workers on 1 shard, 1,600 updates; every planned worker starts together,
    so the whole-run mean staleness is λ - 1 = 7 (within 10% + 0.2)."""
    s = local_run(tmp_path / "run", "--model", "logreg", "--dataset", "synthetic-logreg", "--num-ps", "1",
                  "--num-workers", "8", "--worker-processes", "2", "--max-updates", "1600")
    staleness, steady, start = s["staleness"], s["staleness_steady"], s["start"]
    assert isinstance(staleness, dict) and isinstance(steady, dict) and isinstance(start, dict)
    assert abs(staleness["mean"] - 7) <= 0.1 * 7 + 0.2, staleness["mean"]
    assert abs(steady["mean"] - 7) <= 0.1 * 7 + 0.2, steady["mean"]
    assert start["enabled"] and start["ready"] == 8 and start["late_workers"] == []


@pytest.mark.slow
def test_logical_workers_at_lambda_32(tmp_path: Path) -> None:
    """32 logical workers in 2 processes with a constant 0.5 s step: staleness within 10% of 31, and
    the memory report says what a logical worker costs."""
    run_dir = tmp_path / "run"
    s = local_run(run_dir, "--model", "logreg", "--dataset", "synthetic-logreg", "--num-ps", "1",
                  "--num-workers", "32", "--worker-processes", "2", "--compute-delay", "const:0.5",
                  "--max-updates", "640", "--heartbeat-interval-s", "1")
    staleness, start = s["staleness"], s["start"]
    assert isinstance(staleness, dict) and isinstance(start, dict)
    assert abs(staleness["mean"] - 31) <= 0.1 * 31, staleness["mean"]
    assert start["late_workers"] == []
    memory = json.loads(RunDir(run_dir).memory.read_text())
    # and the fork server the chief and the workers were forked from (asyncps.tools.forkserver)
    assert set(memory["peak_rss_mb"]) == {"chief", "ps-0", "workers-0", "workers-1", "fork-server"}
    # two TensorFlow processes for 32 workers: far below 32 processes' worth
    assert 0 < memory["per_worker_mb"] < memory["peak_rss_mb"]["workers-0"] / 4
    workers = {int(w) for w in json.loads(json.dumps(s["idle_fraction"]))}
    assert workers == set(range(32))


@pytest.mark.slow
def test_killing_a_worker_process_loses_exactly_its_logical_workers(tmp_path: Path) -> None:
    run = RunConfig(model="logreg", num_workers=4, worker_processes=2, num_ps=1, epochs=0.0, max_updates=400,
                    compute_delay="const:0.05", heartbeat_timeout_s=2.0, eval_every_s=30.0)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cluster = LocalCluster(run, run_dir)
    try:
        at_kill = kill_worker_mid_run(cluster, lambda status: status.updates >= 40, worker="workers-1").updates
        killed_at = datetime.datetime.now()
        cluster.chief.proc.wait(timeout=180)
    finally:
        cluster.stop()
    dead = set()
    for line in RunDir(run_dir).log("chief").read_text().splitlines():
        # deaths after the kill (a busy machine may delay heartbeats while TensorFlow loads, earlier)
        found = re.match(r"(\S+ \S+) chief WARNING .*worker (\d+) \(\S+\) missed heartbeats", line)
        if found and datetime.datetime.strptime(found[1], "%Y-%m-%d %H:%M:%S,%f") >= killed_at:
            dead.add(int(found[2]))
    assert dead == {2, 3}  # workers-1 held indices 2 and 3
    summary = json.loads(RunDir(run_dir).summary.read_text())
    assert summary["updates_applied"] >= 400 > at_kill
    assert cluster.exit_codes()["chief"] == 0 and cluster.exit_codes()["workers-0"] == 0
