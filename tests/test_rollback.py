"""Pushes rolled back by a shard restore: which rows restores.csv undoes, and the recorder's
accounting of their examples (summary.json's data)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from asyncps.chief.recorder import Recorder

from asyncps.pb import coordinator_pb2 as cpb
from asyncps.pb import ps_pb2
from asyncps.rules.drops import DropReason
from asyncps.rundir import PushRow, RestoreRow, Rollbacks, RowWriter, RunDir
from asyncps.wire.proto import push_record
from asyncps.wire.shard import PushOutcome

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


def numbered(shard: int, seq: int, incarnation: int, accepted: bool = True) -> PushRow:
    return PushRow(0.0, 0, shard, 1, 0, seq, 0, accepted, "" if accepted else "stale", 0.1, 0.5,
                   incarnation=incarnation, seq=seq)


def test_a_restore_takes_back_the_answers_numbered_above_the_count_it_went_back_to() -> None:
    """By the answers' numbers (pushes.csv seq, restores.csv answers): drops too, and in sync, where a
    version is a step of several pushes; rows or restores without numbers fall back to versions."""
    rollbacks = Rollbacks([RestoreRow(0.0, 1, 100, NEW, "ckpt-00000002", answers=130)])
    assert rollbacks.rolled_back(numbered(1, 131, OLD)) and rollbacks.taken_back(numbered(1, 131, OLD))
    assert not rollbacks.taken_back(numbered(1, 130, OLD))  # answered before the checkpoint
    dropped = numbered(1, 140, OLD, accepted=False)
    assert rollbacks.taken_back(dropped) and not rollbacks.rolled_back(dropped)  # no longer counted; no update undone
    assert not rollbacks.taken_back(numbered(1, 131, NEW))  # the restored state's own answer
    old_file = Rollbacks([RestoreRow(0.0, 1, 100, NEW, "ckpt-00000002")])  # answers -1: not known
    assert old_file.taken_back(numbered(1, 101, OLD)) and not old_file.taken_back(numbered(1, 140, OLD, False))


def test_every_answered_row_is_accounted_against_the_shards_own_count(tmp_path: Path) -> None:
    """summary.json's shards[i]: answers = rows kept + the answers no row reports, by worker."""
    def answered(step: int, seq: int, incarnation: int, accepted: bool = True) -> cpb.PushRecord:
        return cpb.PushRecord(step=step, shard=0, version=seq, accepted=accepted, incarnation=incarnation, seq=seq,
                              drop=ps_pb2.DROP_NONE if accepted else ps_pb2.DROP_STALE)

    recorder = Recorder(tmp_path)
    recorder.add(0, [answered(1, 1, OLD), answered(2, 2, OLD), answered(3, 3, OLD)], [])
    recorder.add(1, [answered(1, 4, OLD, accepted=False)], [])
    recorder.add(1, [cpb.PushRecord(step=2, shard=0, drop=ps_pb2.DROP_NONFINITE)], [])  # skipped: never answered
    with RowWriter(RunDir(tmp_path).restores, RestoreRow, append=True) as out:
        out.write(RestoreRow(0.0, 0, 2, NEW, "ckpt-00000001", answers=2))  # w0's first two answers in it
    recorder.add(0, [answered(4, 3, NEW)], [])  # numbered on from the restored count
    # the shard's final state: 3 answers to w0, and one to w1 that w1 never reported (killed)
    [shard] = recorder.push_accounting([4], [{0: 3, 1: 1}])
    assert shard == {"answers": 4, "answers_by_worker": {"0": 3, "1": 1}, "rows": 6, "rows_taken_back": 2,
                     "unreported": {"1": 1}}
    [exact] = recorder.push_accounting([3], [{0: 3}])
    assert exact["unreported"] == {}
    recorder.close()


def test_a_push_sent_to_an_earlier_incarnation_is_recorded_with_the_one_that_answered_it(tmp_path: Path) -> None:
    """A gradient computed before a restore reaches the restored state: dropped, and numbered on from the
    restored count by it. Its row names that state (not the one it was sent to), so a later restore of
    the shard takes it back exactly when it takes back that state's other answers."""
    late = PushOutcome(False, 0, 100, 0.0, DropReason.RESTORED, "restored", seq=131, incarnation=NEW)
    record = push_record(late, 0.0, 1, 99, 0.5, 7, incarnation=OLD)  # sent with the values of OLD
    assert record.incarnation == NEW and record.seq == 131
    older_shard = push_record(dataclasses.replace(late, incarnation=0), 0.0, 1, 99, 0.5, 7, incarnation=OLD)
    assert older_shard.incarnation == OLD  # a shard that does not say: the one it was sent to
    recorder = Recorder(tmp_path)
    with RowWriter(RunDir(tmp_path).restores, RestoreRow, append=True) as out:
        out.write(RestoreRow(0.0, 1, 100, NEW, "ckpt-00000002", answers=130))
    recorder.add(0, [record], [])
    # kept by NEW's own count (131 answers): nothing taken back, nothing unreported
    [_, shard] = recorder.push_accounting([0, 131], [{}, {0: 131}])
    assert shard["rows_taken_back"] == 0 and shard["unreported"] == {"0": 130}
    with RowWriter(RunDir(tmp_path).restores, RestoreRow, append=True) as out:  # NEW goes back to 130 answers
        out.write(RestoreRow(0.0, 1, 100, NEWER, "ckpt-00000002", answers=130))
    [_, shard] = recorder.push_accounting([0, 130], [{}, {0: 130}])
    assert shard["rows_taken_back"] == 1 and shard["unreported"] == {"0": 130}
    recorder.close()
