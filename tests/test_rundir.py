"""The run directory's formats: summary.json and config.json round trips and validation, the CSV rows."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from asyncps.config import RunConfig
from asyncps.rundir import (
    EVAL_CSV,
    PUSHES_CSV,
    SUMMARY_JSON,
    TIMELINE_CSV,
    EvalRow,
    FinalEval,
    PushRow,
    RowWriter,
    RunConfigRecord,
    RunDirError,
    RunSummary,
    ShardCounters,
    StalenessSummary,
    StepRow,
    read_rows,
    write_rows,
)


def summary(**changes: Any) -> RunSummary:
    base = RunSummary(
        updates_applied=120, updates_dropped=3, staleness=StalenessSummary.of({0: 10, 1: 80, 2: 30}),
        throughput_updates_per_s=60.5, final_eval=FinalEval(0.31, 0.92), wall_s=2.0, mode="async",
        staleness_policy="none", workers=2, ps_shards=2, model="logreg", dataset="synthetic", epochs=1.5,
        stop_reason="reached 120 updates", pushes_recorded=240, dropped_by_reason={"late": 3},
        backup_workers=0, staleness_bound=0,
        shards=(ShardCounters(120, 120, 2), ShardCounters(121, 121, 1, 4096, 8192, {"tcp": {"pushed": 4096,
                                                                                         "pulled": 8192}})),
        data={"tasks_done": 7, "tasks_planned": None}, idle_fraction={0: 0.1, 1: 0.25}, max_clock_lead=1.0)
    return dataclasses.replace(base, **changes)


def test_staleness_summary_of_a_histogram() -> None:
    s = StalenessSummary.of({3: 1, 0: 10, 1: 9})
    assert (s.p50, s.p95, s.max, s.count) == (0, 1, 3, 20) and s.mean == pytest.approx(12 / 20)
    assert list(s.histogram) == [0, 1, 3]
    assert StalenessSummary.of({}) == StalenessSummary(0.0, 0, 0, 0, 0, {})


def test_run_summary_round_trip(tmp_path: Path) -> None:
    diverged = summary(outcome="diverged", verdict="diverged: the final evaluation's loss is nan; ...",
                       nonfinite_steps=133, checkpoints_failed=2)
    for s in (summary(), summary(final_train_loss=0.2, optimality_gap=0.01, stop_reason=None), diverged):
        path = s.save(tmp_path)
        assert path == tmp_path / SUMMARY_JSON
        assert RunSummary.load(tmp_path) == s
        assert RunSummary.from_json(s.to_json()) == s
    on_disk = json.loads(path.read_text())
    assert on_disk["staleness"]["histogram"] == {"0": 10, "1": 80, "2": 30}  # the file's shape is unchanged
    assert on_disk["idle_fraction"] == {"0": 0.1, "1": 0.25} and on_disk["shards"][1]["version"] == 121
    assert on_disk["shards"][1]["bytes_by_transport"] == {"tcp": {"pushed": 4096, "pulled": 8192}}
    del on_disk["shards"][1]["bytes_by_transport"]  # written before the transports were counted apart
    assert RunSummary.from_dict(on_disk).shards[1].bytes_by_transport == {}
    assert "optimality_gap" not in summary().to_dict()  # only written when the optimum is known
    assert summary(stop_reason="interrupted").interrupted and not summary().interrupted
    assert diverged.diverged and not summary().diverged and "outcome" not in summary().to_dict()
    nan = RunSummary.from_json(summary(final_eval=FinalEval(math.nan, 0.0)).to_json())
    assert math.isnan(nan.final_eval.loss)


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d.pop("wall_s"), "missing field 'wall_s'"),
    (lambda d: d["staleness"].update(p95="a"), "field 'staleness.p95': expected an integer, got 'a'"),
    (lambda d: d.update(updates_applied=True), "field 'updates_applied': expected an integer"),
    (lambda d: d.update(final_eval=[1, 2]), "field 'final_eval' must be a JSON object"),
    (lambda d: d["shards"][1].pop("dropped"), "missing field 'shards[1].dropped'"),
    (lambda d: d.update(idle_fraction={"w0": 0.5}), "field 'idle_fraction': expected integer keys, got 'w0'"),
    (lambda d: d.update(mode=3), "field 'mode': expected a string, got 3"),
    (lambda d: d["shards"][1]["bytes_by_transport"]["tcp"].update(pushed="x"),
     "field 'shards[1].bytes_by_transport.tcp.pushed': expected an integer, got 'x'"),
])
def test_run_summary_validation_names_the_file_and_the_field(tmp_path: Path, change: Any, message: str) -> None:
    data = summary().to_dict()
    change(data)
    (tmp_path / SUMMARY_JSON).write_text(json.dumps(data))
    with pytest.raises(RunDirError) as info:
        RunSummary.load(tmp_path)
    assert str(tmp_path / SUMMARY_JSON) in str(info.value) and message in str(info.value)


def test_run_summary_errors_on_a_file_that_is_not_a_summary(tmp_path: Path) -> None:
    (tmp_path / SUMMARY_JSON).write_text("[1, 2]")
    with pytest.raises(RunDirError, match="the file must be a JSON object"):
        RunSummary.load(tmp_path)
    (tmp_path / SUMMARY_JSON).write_text("{")
    with pytest.raises(RunDirError, match="not JSON"):
        RunSummary.load(tmp_path)


def test_an_older_summary_without_the_later_fields_reads(tmp_path: Path) -> None:
    data = summary().to_dict()
    for later in ("data", "idle_fraction", "max_clock_lead", "nonfinite_steps", "checkpoints_failed"):
        del data[later]  # not written by the first chiefs (nor outcome and verdict, None here)
    data["from_the_future"] = {"x": 1}  # unknown keys are ignored
    s = RunSummary.from_dict(data)
    assert s.data == {} and s.idle_fraction == {} and s.max_clock_lead == 0.0
    assert math.isnan(s.mean_idle_fraction())
    assert s == summary(data={}, idle_fraction={}, max_clock_lead=0.0)
    assert (s.outcome, s.verdict, s.nonfinite_steps, s.checkpoints_failed, s.diverged) == (None, None, 0, 0, False)


def test_config_record_round_trip(tmp_path: Path) -> None:
    run = RunConfig(num_workers=3, mode="sync")
    record = RunConfigRecord.of(run, ["a:1", "b:2"], tmp_path)
    record.save(tmp_path)
    back = RunConfigRecord.load(tmp_path)
    assert back == record and back.run["num_workers"] == 3 and back.ps == ("a:1", "b:2")
    assert json.loads((tmp_path / "config.json").read_text())["run"] == json.loads(run.to_json())
    assert RunConfigRecord.load_if_present(tmp_path / "nowhere") is None
    (tmp_path / "config.json").write_text(json.dumps({"run": 3}))
    with pytest.raises(RunDirError, match="field 'run': expected an object"):
        RunConfigRecord.load(tmp_path)


ROWS: list[tuple[str, type[Any], list[Any]]] = [
    (PUSHES_CSV, PushRow, [PushRow(100.5, 0, 1, 7, 3, 5, 2, True, "", 0.05, 0.693147),
                           PushRow(100.75, 1, 0, 2, 1, 9, 8, False, "stale", 0.1, math.inf, "staleness 8 > 4, sorry")]),
    (TIMELINE_CSV, StepRow, [StepRow(0, 1, 100.0, 0.25, 0.5, 0.125, 0.0, 32),
                             StepRow(1, 2, 101.5, 0, 0.5, 0.5, 1, 16)]),
    (EVAL_CSV, EvalRow, [EvalRow(1000.125, 0.5, 10, (9, 11), 0.5, 0.875), EvalRow(1001.0, 1.0, 20, (), 0.25, 1.0)]),
]


@pytest.mark.parametrize(("name", "row_type", "rows"), ROWS)
def test_rows_round_trip(tmp_path: Path, name: str, row_type: type[Any], rows: list[Any]) -> None:
    path = tmp_path / name
    assert name == row_type.FILE
    write_rows(path, rows[:1], row_type)
    with RowWriter(path, row_type, append=True) as writer:  # a resumed run continues the file
        writer.write(rows[1])
    text = path.read_text()
    assert text.splitlines()[0] == ",".join(f.name for f in dataclasses.fields(row_type))
    assert text.count("\n") == 3
    assert read_rows(path, row_type) == rows
    assert read_rows(tmp_path / "absent.csv", row_type) == []


def test_row_formats_are_the_chiefs() -> None:
    assert PushRow(1.5, 0, 1, 2, 3, 4, 1, True, "", 0.1, 0.5).cells() == [
        "1.500000", "0", "1", "2", "3", "4", "1", "1", "", "0.1", "0.5", "", "1", "0", "0", "0", "0", "0", "0",
        "0", "0", "0"]
    assert EvalRow(1.0, 2.0, 3, (4, 5), 0.5, 0.25).cells() == ["1.000", "2.000", "3", "4|5", "0.500000", "0.250000"]


def test_a_torn_line_is_skipped_and_a_bad_value_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / TIMELINE_CSV
    rows = ROWS[1][2]
    write_rows(path, rows, StepRow)
    with open(path, "a") as f:
        f.write("0,3,102.0,0.0")  # the chief was killed while writing this line
    assert read_rows(path, StepRow) == rows
    with open(path, "a") as f:
        f.write("\n0,x,102.0,0.0,0.5,0.1,0.0,32\n")
    with pytest.raises(RunDirError, match=r"timeline.csv:5: column 'step': cannot read 'x' as int"):
        read_rows(path, StepRow)


def test_an_older_pushes_csv_without_drop_detail_reads(tmp_path: Path) -> None:
    path = tmp_path / PUSHES_CSV
    path.write_text("wall_time,worker,shard,step,base_version,version,staleness,accepted,drop_reason,"
                    "effective_lr,loss\r\n100.5,0,1,7,3,5,2,0,stale,0.05,0.5\r\n")
    assert read_rows(path, PushRow) == [PushRow(100.5, 0, 1, 7, 3, 5, 2, False, "stale", 0.05, 0.5, "", 1)]
    with pytest.raises(RunDirError, match="cannot append"):  # resuming it would mix two formats
        RowWriter(path, PushRow, append=True)


def test_a_file_of_another_format_is_refused(tmp_path: Path) -> None:
    path = tmp_path / EVAL_CSV
    path.write_text("wall_time,elapsed_s,loss\n1,2,3\n")
    with pytest.raises(RunDirError, match=r"no column\(s\) \['updates', 'shard_versions', 'accuracy'\]"):
        read_rows(path, EvalRow)
    with pytest.raises(RunDirError, match="cannot append"):
        RowWriter(path, EvalRow, append=True)
