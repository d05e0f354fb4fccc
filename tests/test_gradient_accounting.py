"""Exactly-once at the gradient level: summary.json counts the examples whose gradients were
applied, dropped or partially applied, checked against pushes.csv and timeline.csv."""

from __future__ import annotations

import collections
import csv
import json
from pathlib import Path

import pytest
from asyncps.chief.recorder import Recorder

from asyncps.pb import coordinator_pb2 as cpb
from asyncps.rundir import RunDir
from tests.test_local_cluster import run_cli


def push(step: int, shard: int, accepted: bool) -> cpb.PushRecord:
    return cpb.PushRecord(step=step, shard=shard, accepted=accepted)


def test_recorder_counts_examples_by_what_became_of_their_gradient(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path)
    recorder.add(0, [push(1, 0, True), push(1, 1, True), push(2, 0, False), push(2, 1, False),
                     push(3, 0, True), push(3, 1, False)],
                 [cpb.StepTiming(step=s, examples=n) for s, n in ((1, 32), (2, 16), (3, 8), (4, 4))])
    recorder.close()
    assert recorder.example_outcomes() == {"examples_applied": 32, "examples_dropped": 16,
                                           "examples_partially_applied": 8, "examples_not_pushed": 4,
                                           "examples_nonfinite": 0, "examples_rolled_back": 0}


@pytest.mark.slow
def test_summary_counts_applied_dropped_and_partial_examples_as_the_run_records_show(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_cli(["local", "--run-dir", str(run_dir), "--num-workers", "3", "--num-ps", "2", "--epochs", "3",
                      "--staleness-policy", "drop:bound=0", "--eval-every-s", "30", "--quiet"])
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(RunDir(run_dir).summary.read_text())["data"]
    with open(RunDir(run_dir).pushes) as f:
        accepted = collections.defaultdict(list)
        for row in csv.DictReader(f):
            accepted[(row["worker"], row["step"])].append(row["accepted"] == "1")
    expected: collections.Counter[str] = collections.Counter()
    with open(RunDir(run_dir).timeline) as f:
        for row in csv.DictReader(f):
            outcome = accepted[(row["worker"], row["step"])]
            kind = ("applied" if all(outcome) else "partially_applied" if any(outcome) else "dropped")
            expected[kind] += int(row["examples"])
    for kind in ("applied", "dropped", "partially_applied"):
        assert data[f"examples_{kind}"] == expected[kind], (kind, data, expected)
    assert data["examples_applied"] > 0 and data["examples_dropped"] > 0  # a bound of 0 drops some
    total = sum(data[f"examples_{k}"] for k in ("applied", "dropped", "partially_applied", "not_pushed", "nonfinite"))
    assert total == data["examples_done"]  # every example trained on once, none lost or repeated
