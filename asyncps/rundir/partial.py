"""The summary of a run without summary.json: one still going, or one whose chief died before writing
it. Built from what the chief had written as the run went (config.json and the CSVs), so the tools
can report on any run directory; what the CSVs cannot tell (the final evaluation, epochs) is the last
known value or NaN."""

from __future__ import annotations

import collections
import math
from pathlib import Path
from typing import Any

from asyncps.rundir.names import CONFIG_JSON, PUSHES_CSV, SUMMARY_JSON, RunDir, RunDirError
from asyncps.rundir.summary import FinalEval, RunConfigRecord, RunSummary, ShardCounters, StalenessSummary
from asyncps.rundir.tables import EvalRow, PushRow, StepRow, read_rows

#: The stop reason of a summary built from the CSVs.
UNFINISHED = "unfinished: no summary.json (the run is still going, or its chief stopped before writing it)"


def _setting(run: dict[str, Any], name: str, default: Any) -> Any:
    value = run.get(name, default)
    return default if value is None else value


def summary_from_tables(run_dir: Path) -> RunSummary:
    """What config.json, pushes.csv, timeline.csv and eval.csv say of the run so far."""
    record = RunConfigRecord.load_if_present(run_dir)
    files = RunDir(run_dir)
    pushes = read_rows(files.pushes, PushRow)
    if record is None and not pushes:
        raise RunDirError(f"{run_dir}: not a run directory (no {SUMMARY_JSON}, {CONFIG_JSON} or {PUSHES_CSV})")
    run = dict(record.run) if record is not None else {}
    steps = read_rows(files.timeline, StepRow)
    evals = read_rows(files.evals, EvalRow)
    histogram = collections.Counter(p.staleness for p in pushes)
    by_shard: dict[int, list[PushRow]] = collections.defaultdict(list)
    for p in pushes:
        by_shard[p.shard].append(p)
    shards = tuple(ShardCounters(version=max(p.version for p in rows), accepted=sum(p.accepted for p in rows),
                                 dropped=sum(not p.accepted for p in rows))
                   for _, rows in sorted(by_shard.items()))
    applied = round(sum(s.accepted for s in shards) / len(shards)) if shards else 0
    dropped = round(sum(s.dropped for s in shards) / len(shards)) if shards else 0
    accepted_times = [p.wall_time for p in pushes if p.accepted]
    wall_s = max(p.wall_time for p in pushes) - min(accepted_times) if accepted_times else 0.0
    busy: dict[int, float] = collections.defaultdict(float)
    waited: dict[int, float] = collections.defaultdict(float)
    for s in steps:
        busy[s.worker] += s.pull_s + s.compute_s + s.push_s
        waited[s.worker] += s.wait_s
    last = evals[-1] if evals else None
    return RunSummary(
        updates_applied=applied,
        updates_dropped=dropped,
        staleness=StalenessSummary.of(histogram),
        throughput_updates_per_s=applied / wall_s if wall_s > 0 else 0.0,
        final_eval=FinalEval(loss=last.loss, accuracy=last.accuracy) if last else FinalEval(math.nan, math.nan),
        wall_s=wall_s,
        mode=str(_setting(run, "mode", "async")),
        staleness_policy=str(_setting(run, "staleness_policy", "none")),
        workers=int(_setting(run, "num_workers", len({s.worker for s in steps}))),
        ps_shards=int(_setting(run, "num_ps", len(shards))),
        model=str(_setting(run, "model", "")),
        dataset=str(_setting(run, "dataset", "")),
        epochs=math.nan,  # the CSVs do not know the size of the training set
        stop_reason=UNFINISHED,
        pushes_recorded=len(pushes),
        dropped_by_reason=dict(collections.Counter(p.drop_reason for p in pushes if not p.accepted)),
        backup_workers=int(_setting(run, "backup_workers", 0)),
        staleness_bound=int(_setting(run, "staleness_bound", 0)),
        shards=shards,
        idle_fraction={w: waited[w] / (busy[w] + waited[w]) for w in sorted(busy) if busy[w] + waited[w] > 0},
    )


def load_summary(run_dir: Path) -> RunSummary:
    """summary.json when the run wrote it, else the summary of its CSVs (stop reason UNFINISHED)."""
    if RunDir(run_dir).summary.exists():
        return RunSummary.load(run_dir)
    return summary_from_tables(run_dir)


def is_run_dir(path: Path) -> bool:
    """True for a directory a chief wrote: it has summary.json or at least config.json."""
    return RunDir(path).summary.exists() or RunDir(path).config.exists()
