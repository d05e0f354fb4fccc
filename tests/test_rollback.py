"""Pushes rolled back by a shard restore: which rows restores.csv undoes, and the recorder's
accounting of their examples (summary.json's data)."""

from __future__ import annotations

from pathlib import Path

from asyncps.chief.recorder import Recorder

from asyncps.pb import coordinator_pb2 as cpb
from asyncps.rundir import PushRow, RestoreRow, Rollbacks, RowWriter, RunDir

OLD, NEW, NEWER = 11, 22, 33  # incarnations: the initial state, then two restores


def row(shard: int, version: int, incarnation: int, accepted: bool = True) -> PushRow:
    return PushRow(0.0, 0, shard, 1, version - 1, version, 0, accepted, "" if accepted else "stale", 0.1, 0.5,
                   incarnation=incarnation)


def test_a_restore_rolls_back_the_accepted_pushes_after_its_version_of_the_states_before_it() -> None:
    rollbacks = Rollbacks([RestoreRow(0.0, 1, 100, NEW, "ckpt-00000002")])
    assert rollbacks.rolled_back(row(1, 101, OLD))  # the initial state's push after the checkpoint
    assert not rollbacks.rolled_back(row(1, 100, OLD))  # in the checkpoint
    assert not rollbacks.rolled_back(row(1, 101, NEW))  # applied to the restored state
    assert not rollbacks.rolled_back(row(0, 150, OLD))  # another shard
    assert not rollbacks.rolled_back(row(1, 120, OLD, accepted=False))  # a drop changed nothing
    assert not rollbacks.rolled_back(row(1, 120, 0))  # an older worker's row cannot be placed
    rollbacks.add(RestoreRow(0.0, 1, 110, NEWER, "ckpt-00000003"))
    assert rollbacks.rolled_back(row(1, 111, NEW)) and not rollbacks.rolled_back(row(1, 110, NEW))
    assert rollbacks.rolled_back(row(1, 105, OLD))  # still gone: the first restore went back to 100
    assert not rollbacks.rolled_back(row(1, 140, NEWER))


def record(shard: int, step: int, version: int, incarnation: int) -> cpb.PushRecord:
    return cpb.PushRecord(step=step, shard=shard, version=version, accepted=True, incarnation=incarnation)


def test_the_recorder_counts_the_examples_of_rolled_back_steps_and_the_rows_per_shard(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path)
    # steps 1-3 applied on both shards; shard 1 is then restored to version 1: steps 2 and 3 are
    # rolled back there (their shard-0 pushes stay applied); step 4 goes to the restored state
    recorder.add(0, [record(s, step, step, OLD) for step in (1, 2, 3) for s in (0, 1)]
                 + [record(0, 4, 4, OLD), record(1, 4, 2, NEW)],
                 [cpb.StepTiming(step=s, examples=n) for s, n in ((1, 32), (2, 16), (3, 8), (4, 4))])
    assert recorder.example_outcomes()["examples_rolled_back"] == 0
    with RowWriter(RunDir(tmp_path).restores, RestoreRow, append=True) as out:
        out.write(RestoreRow(0.0, 1, 1, NEW, "ckpt-00000001"))
    outcomes = recorder.example_outcomes()
    assert outcomes["examples_applied"] == 32 + 4 and outcomes["examples_rolled_back"] == 16 + 8
    assert sum(outcomes.values()) == 60  # every example once
    assert recorder.rolled_back_by_shard() == {1: 2}
    recorder.close()
    again = Recorder(tmp_path, append=True)  # a restarted chief reads the same from the files
    assert again.example_outcomes() == outcomes and again.rolled_back_by_shard() == {1: 2}
    again.close()
