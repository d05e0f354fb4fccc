"""A run whose workers are all gone ends with an error instead of waiting forever (issue 24, item 2)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from asyncps.chief.lifecycle import EXIT_NO_WORKERS

from asyncps.config import RunConfig
from asyncps.rundir import RunDir
from asyncps.tools.local import LocalCluster
from tests.conftest import start_until


def test_the_default_grace_covers_two_heartbeat_timeouts_and_the_start() -> None:
    assert RunConfig(heartbeat_timeout_s=10.0).no_workers_grace_s() == 80.0
    assert RunConfig(idle_without_workers_s=7.0).no_workers_grace_s() == 7.0
    with pytest.raises(ValueError, match="idle_without_workers_s"):
        RunConfig(idle_without_workers_s=-1.0)


@pytest.mark.slow
def test_an_epochs_run_whose_workers_all_died_ends_with_its_summary_and_exit_6(tmp_path: Path) -> None:
    """Every worker killed -9 and none restarted: the chief reaps them, waits the grace period, writes
    summary.json with the reason and exits 6 (before: it waited for its epochs forever)."""
    run = RunConfig(num_workers=2, num_ps=1, epochs=200.0, eval_every_s=30.0, heartbeat_timeout_s=2.0,
                    idle_without_workers_s=4.0, checkpoint_every_s=0.0)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cluster = LocalCluster(run, run_dir)
    try:
        start_until(cluster, lambda status: status.updates >= 20)
        for worker in (c for c in cluster.children if c.name.startswith("worker-")):
            worker.proc.send_signal(signal.SIGKILL)
            worker.proc.wait()
        deadline = time.monotonic() + 90
        while cluster.chief.alive():
            assert time.monotonic() < deadline, "the chief waits forever for workers that are gone"
            time.sleep(0.2)
    finally:
        cluster.stop()
    assert cluster.exit_codes()["chief"] == EXIT_NO_WORKERS
    summary = json.loads(RunDir(run_dir).summary.read_text())
    assert summary["stop_reason"].startswith("no worker alive for "), summary["stop_reason"]
    assert summary["updates_applied"] >= 20
    assert "exiting 6" in RunDir(run_dir).log("chief").read_text()
