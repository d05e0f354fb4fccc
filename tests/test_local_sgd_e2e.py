"""Local SGD end to end on two real shards: async and sync train to a sensible accuracy with H=4;
in sync (with DiLoCo's outer Nesterov) every step is decided once for both shards and every
checkpoint is one model."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
from asyncps.chief.checkpoint import CheckpointDir

from asyncps.rundir import PushRow, RunDir, StepRow, read_rows
from asyncps.rundir.names import CheckpointNames
from tests.test_local_cluster import run_cli

pytestmark = pytest.mark.slow

H = 4


def train(tmp_path: Path, *flags: str) -> tuple[Path, dict[str, object]]:
    run_dir = tmp_path / "run"
    result = run_cli(["local", "--run-dir", str(run_dir), "--quiet", "--num-ps", "2", "--num-workers", "2",
                      "--epochs", "12", "--eval-every-s", "30", "--local-steps", str(H), *flags])
    assert result.returncode == 0, result.stdout + result.stderr
    return run_dir, json.loads(RunDir(run_dir).summary.read_text())


def test_async_local_sgd_with_averaging_trains(tmp_path: Path) -> None:
    run_dir, summary = train(tmp_path, "--outer", "average")
    assert summary["final_eval"]["accuracy"] >= 0.9, summary["final_eval"]  # type: ignore[index]
    pushes = read_rows(RunDir(run_dir).pushes, PushRow)
    # every push carries H local steps, fewer only where a round ended early with the run's last data
    assert pushes and sum(p.local_steps == H for p in pushes) >= len(pushes) - 4
    steps = read_rows(RunDir(run_dir).timeline, StepRow)
    carried = {(p.worker, p.step): p.local_steps for p in pushes}
    assert len(steps) == len(carried)
    for s in steps:  # each local step one batch (a data task's last may be short)
        assert (carried[(s.worker, s.step)] - 1) * 32 < s.examples <= carried[(s.worker, s.step)] * 32
    # one version per applied delta: staleness is counted in outer versions
    for shard in (0, 1):
        applied = sorted(p.version for p in pushes if p.shard == shard and p.accepted)
        assert applied == list(range(1, len(applied) + 1))


def test_sync_local_sgd_decides_each_step_once_for_both_shards_and_checkpoints_one_model(tmp_path: Path) -> None:
    run_dir, summary = train(tmp_path, "--mode", "sync", "--outer", "nesterov:lr=0.7,momentum=0.9",
                             "--checkpoint-every-updates", "10", "--checkpoint-every-s", "off", "--keep-checkpoints",
                             "100")
    assert summary["final_eval"]["accuracy"] >= 0.9, summary["final_eval"]  # type: ignore[index]
    sets: dict[tuple[int, int], set[int]] = collections.defaultdict(set)
    for row in read_rows(RunDir(run_dir).pushes, PushRow):
        assert row.local_steps <= H  # fewer only where a round ended early: the run's last data
        if row.accepted:
            sets[(row.shard, row.base_version)].add(row.worker)
    versions = sorted({v for _, v in sets})
    assert len(versions) >= 10
    assert all(sets[(0, v)] == sets[(1, v)] == {0, 1} for v in versions), "a step decided differently per shard"
    checkpoints = sorted(p for p in RunDir(run_dir).checkpoints.iterdir() if CheckpointNames.number_of(p) is not None)
    assert checkpoints
    for path in checkpoints:
        shard_versions = CheckpointDir.load(path).manifest["shard_versions"]
        assert len(set(shard_versions)) == 1, (path.name, shard_versions)
