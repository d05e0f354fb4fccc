"""The K-variants end to end: `asyncps local` with 3 workers on 2 real shard processes finishes
with a summary; both shards applied the same pushes and reached the same version (one decision
for all shards), and staleness and idle time are recorded as for every mode."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

from asyncps.rundir import PushRow, RunDir, read_rows
from tests.test_local_cluster import run_cli

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mode", ["k-async:k=2", "k-batch-sync:k=2", "k-batch-async:k=2"])
def test_a_k_mode_on_two_shards_finishes_with_one_model_and_records_staleness(tmp_path: Path, mode: str) -> None:
    run_dir = tmp_path / "run"
    result = run_cli(["local", "--run-dir", str(run_dir), "--quiet", "--model", "logreg", "--mode", mode,
                      "--num-workers", "3", "--num-ps", "2", "--max-updates", "40"])
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(RunDir(run_dir).summary.read_text())
    assert summary["mode"] == mode and summary["updates_applied"] >= 40
    # one decision for all shards: the checkpoint cut leaves both at shard 0's step, and every
    # push applied on one shard was applied on the other
    versions = [s["version"] for s in summary["shards"]]
    assert versions[0] == versions[1] >= 40
    applied: dict[int, set[tuple[int, int]]] = collections.defaultdict(set)
    for row in read_rows(RunDir(run_dir).pushes, PushRow):
        if row.accepted:
            applied[row.shard].add((row.worker, row.step))
    assert applied[0] and applied[0] == applied[1]
    assert summary["staleness"]["count"] > 0 and set(summary["idle_fraction"]) == {"0", "1", "2"}
    if mode != "k-batch-sync:k=2":  # the async variants take stale gradients
        assert summary["staleness"]["max"] >= 1
